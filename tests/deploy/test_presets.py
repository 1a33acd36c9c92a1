"""Every preset (``presets/<name>.values.yaml`` + its bare-metal ``presets/<name>.yaml``): the header line says how it
was measured, the chart renders it into valid manifests whose GPUs add up to the node, the trainer's schema accepts
its config, the bare-metal file is exactly what the values file generates, and the chart keeps the run (an output
volume or a refusal, checkpoints, ``--resume auto``)."""

from __future__ import annotations

import re

import pytest
import yaml
from deploy_helpers import (
    REPO,
    args_of,
    assert_lint_clean,
    assert_valid_kubernetes,
    flag,
    helm,
    load_values,
    manifests_of,
    pod_spec,
    render_chart,
    train_yaml,
    workload,
)

from trainer.cli import main
from trainer.config.loader import deep_merge
from trainer.config.schema import validate_config
from trainer.deploy import presets
from trainer.deploy.checks import check_manifests

NAMES = presets.names()
#: the layouts users' nodes have: name -> (node GPUs, rollout servers, learner ranks)
EXPECTED = {
    "colocate-8-2b-full": (8, 0, 8), "colocate-8-4b-full": (8, 0, 8), "colocate-8-8b-lora": (8, 0, 8),
    "colocate-8-8b-full-zero2": (8, 0, 8), "6v2-2b-full": (8, 6, 2), "7v1-2b-full": (8, 7, 1),
    "3v1-2b-full": (4, 3, 1), "colocate-4-2b-full": (4, 0, 4),
}
HEADER = re.compile(r"^# (Measured 20\d\d-\d\d-\d\d on \d+ x [A-Z]\d+ .*\d+\.\d+ trained samples/s.*"
                    r"|Not yet run on (8 GPUs|any GPU)\b.*)$")


def _values(name):
    return load_values(f"presets/{name}.values.yaml")


def _rendered(name, overrides=None):
    values = _values(name)
    return manifests_of(render_chart(deep_merge(values, overrides) if overrides else values))


def test_the_presets_are_the_expected_layouts():
    assert NAMES == sorted(EXPECTED)
    root = sorted(p.name for p in REPO.glob("values-*.yaml"))
    assert root == sorted(presets.ROOT_VALUES), "the layouts live under presets/; the root holds only the entry points"
    assert set(presets.ROOT_VALUES.values()) <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_header_line_says_how_it_was_measured(name):
    first = presets.values_path(name).read_text().splitlines()[0]
    assert HEADER.match(first), f"presets/{name}.values.yaml line 1: {first!r}"
    assert presets.config_path(name).read_text().splitlines()[0] == first
    if not first.startswith("# Not yet run"):
        assert "python -m trainer bench" in first, "a measured figure names the command that reproduces it"
    assert not re.search(r"session \d", presets.values_path(name).read_text(), re.I)


@pytest.mark.parametrize("name", NAMES)
def test_renders_valid_manifests_whose_gpus_add_up_to_the_node(name):
    values = _values(name)
    assert_lint_clean(values)
    docs = _rendered(name)
    assert_valid_kubernetes(docs)
    node, n_servers, ranks = EXPECTED[name]
    assert values["node"]["gpuCount"] == node
    assert check_manifests(docs, node) == []
    servers, (learner,) = workload(docs, "rollout-server"), workload(docs, "learner")
    assert len(servers) == n_servers and flag(args_of(learner), "--nproc-per-node") == str(ranks)
    gpus = [pod_spec(d)["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] for d in [*servers, learner]]
    assert sum(gpus) == node, f"{name}: {gpus} GPUs on a {node}-GPU node"


@pytest.mark.parametrize("name", NAMES)
def test_the_trainer_validates_it_and_the_bare_metal_config_is_the_mounted_one(name, capsys):
    mounted = train_yaml(_rendered(name))
    cfg = validate_config(mounted, source=name)
    bare = yaml.safe_load(presets.config_path(name).read_text())
    assert bare == mounted, f"presets/{name}.yaml is not what the chart mounts: run `make presets`"
    # the keys and rules: its model and data paths are the pod's mounts (what the node has is checked there)
    assert main(["validate", "--schema-only", str(presets.config_path(name))]) == 0, capsys.readouterr().err
    t, rm = cfg.training, cfg.custom.extra.rollout_matching
    assert (t.bf16, cfg.model.torch_dtype, t.checkpointing_policy, t.compile_decoder_layers) == (
        True, "bfloat16", "auto", True)
    assert t.save_steps > 0 and t.packing_length >= rm.vllm.max_model_len
    assert cfg.model.path.startswith("/models/Qwen3-VL-") and cfg.model.path.endswith("-Instruct-coord")
    size = re.search(r"-(\d+b)-", name).group(1).upper()
    assert f"Qwen3-VL-{size}-" in cfg.model.path
    assert rm.rollout_backend == "vllm" and rm.decoding.max_new_tokens < rm.vllm.max_model_len
    if name.startswith("colocate"):
        assert (rm.vllm.mode, rm.vllm.tensor_parallel_size) == ("colocate", 1)
        assert 0 < rm.vllm.gpu_memory_utilization <= 0.35 and rm.vllm.sleep_level in (2, "kv_cache")
    else:
        assert rm.vllm.mode == "server"
        assert _values(name)["rolloutServer"]["model"] == cfg.model.path, "servers decode the policy trained"
    tuner = {"full": "full", "lora": "lora"}[name.split("-")[-1] if "zero" not in name else "full"]
    assert cfg.tuner.train_type == tuner
    assert (t.deepspeed == "zero2") == name.endswith("zero2")


def test_bare_metal_configs_are_generated_from_the_values_files():
    assert presets.stale() == [], "run `make presets` (python -m trainer.deploy.presets)"


def test_the_root_values_files_are_generated_from_their_presets():
    assert presets.stale_root_values() == [], "run `make presets` (python -m trainer.deploy.presets)"
    for alias, name in presets.ROOT_VALUES.items():
        root, preset = yaml.safe_load((REPO / alias).read_text()), _values(name)
        assert root == deep_merge(preset, {"storage": {"output": {"hostPath": presets.ROOT_OUTPUT_HOST_PATH}}}), alias
        assert (REPO / alias).read_text().splitlines()[0] == presets.header(name), "the same measured line"


def test_a_changed_preset_makes_its_root_values_file_stale(tmp_path):
    for name in presets.ROOT_VALUES.values():
        (tmp_path / presets.values_path(name).name).write_text(presets.values_path(name).read_text())
    assert presets.stale_root_values(tmp_path) == []
    edited = presets.values_path("6v2-2b-full", tmp_path)
    edited.write_text(edited.read_text().replace("healthTimeoutS: 900", "healthTimeoutS: 600"))
    assert presets.stale_root_values(tmp_path) == ["values-6v2.yaml"]
    edited.write_text(edited.read_text() + "storage: {output: {claimName: runs}}\n")
    with pytest.raises(ValueError, match="sets storage"):
        presets.root_values_text("values-6v2.yaml", tmp_path)


def test_a_changed_values_file_makes_its_bare_metal_config_stale(tmp_path):
    for name in ("3v1-2b-full", "colocate-8-2b-full"):
        for path in (presets.values_path(name), presets.config_path(name)):
            (tmp_path / path.name).write_text(path.read_text())
    assert presets.stale(tmp_path) == []
    edited = presets.values_path("3v1-2b-full", tmp_path)
    edited.write_text(edited.read_text().replace("records_per_step: 48", "records_per_step: 60"))
    assert presets.stale(tmp_path) == ["3v1-2b-full"]
    assert presets.main(["--check"]) == 0


@pytest.mark.parametrize("name", NAMES)
def test_the_bare_metal_learner_command_runs_as_written(name, capsys):
    commands = [line.removeprefix("#   ") for line in presets.config_path(name).read_text().splitlines()
                if line.startswith("#   python -m trainer launch")]
    *servers, learner = commands
    assert len(servers) == EXPECTED[name][1]
    argv = learner.split()[3:]
    assert argv[:4] == ["launch", "learner", "--config", f"presets/{name}.yaml"] and "--resume" in argv
    argv[3] = str(REPO / argv[3])
    assert main([*argv, "--print-command", "--master-port", "29600"]) == 0
    printed = capsys.readouterr().out
    assert "torch.distributed.run --nproc_per_node" in printed and f"--config {argv[3]}" in printed


# --- the chart keeps the run ------------------------------------------------------------------------------------

def test_the_chart_refuses_to_render_without_an_output_volume():
    values = load_values("presets/colocate-8-2b-full.values.yaml", install_set=False)
    with pytest.raises(helm.HelmRenderError) as err:
        render_chart(values)
    assert "storage.output: the learner's checkpoints need a volume that outlives the pod" in str(err.value)
    assert "storage.output.ephemeral=true" in str(err.value)
    with pytest.raises(helm.HelmRenderError, match="drop one of them"):
        render_chart(deep_merge(values, {"storage": {"output": {"hostPath": "/data/runs", "ephemeral": True}}}))


@pytest.mark.parametrize(("output", "volume"), [
    ({"hostPath": "/data/runs"}, {"hostPath": {"path": "/data/runs", "type": "Directory"}}),
    ({"claimName": "runs"}, {"persistentVolumeClaim": {"claimName": "runs"}}),
    ({"ephemeral": True}, {"emptyDir": {"sizeLimit": "100Gi"}}),
])
def test_output_volume(output, volume):
    values = deep_merge(load_values("presets/6v2-2b-full.values.yaml", install_set=False), {"storage": {"output": output}})
    docs = manifests_of(render_chart(values))
    assert_valid_kubernetes(docs)
    (learner,) = workload(docs, "learner")
    (vol,) = [v for v in pod_spec(learner)["volumes"] if v["name"] == "output"]
    assert {k: v for k, v in vol.items() if k != "name"} == volume
    assert train_yaml(docs)["training"]["output_dir"].startswith("/output/")


def test_the_learner_resumes_from_its_last_checkpoint_by_default():
    (learner,) = workload(_rendered("colocate-8-2b-full"), "learner")
    assert flag(args_of(learner), "--resume") == "auto"
    (learner,) = workload(_rendered("colocate-8-2b-full", {"learner": {"resume": "never"}}), "learner")
    assert "--resume" not in args_of(learner)
    defaults = load_values(None)
    assert train_yaml(manifests_of(render_chart(defaults)))["training"]["save_steps"] == 200
