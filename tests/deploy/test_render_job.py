"""``python -m trainer render-job``: training config → Kubernetes Job specs (jobs/*.j2), dry run and submission."""

from __future__ import annotations

import textwrap

import pytest
import yaml
from deploy_helpers import REPO, args_of, assert_valid_kubernetes, flag, pod_spec, workload

from trainer.cli import main
from trainer.config.errors import ConfigErrors
from trainer.config.loader import resolve_yaml
from trainer.config.schema import validate_config
from trainer.deploy import submit as submit_mod
from trainer.deploy.checks import check_manifests
from trainer.deploy.cli import build_manifests
from trainer.deploy.render import render_manifests, to_yaml
from trainer.deploy.schema import DeployConfig
from trainer.deploy.topology import plan_topology

CONFIGS = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "configs").glob("*.yaml"))
TEMPLATE = (REPO / "configs" / "rollout_matching_sft_template.yaml").as_posix()


#: every rendered config names the learner's output volume (render-job refuses one without: the run must outlive
#: the pod; test_render_job_refuses_a_config_without_an_output_volume)
OUTPUT = {"output_host_path": "/data/runs"}


def _write(tmp_path, name, text):
    """``text`` as a config file, ``deploy.output_host_path`` added when the text is a mapping that lacks it."""
    path = tmp_path / name
    text = textwrap.dedent(text)
    data = yaml.safe_load(text)
    if isinstance(data, dict) and not (data.get("deploy") or {}).get("output_host_path"):
        data["deploy"] = {**(data.get("deploy") or {}), **OUTPUT}
        text = yaml.safe_dump(data, sort_keys=False)
    path.write_text(text)
    return path


def _with_output(config, tmp_path):
    """A config extending ``config`` (a repository path) with an output volume."""
    return _write(tmp_path, "with-output.yaml", f"extends: {(REPO / config).as_posix()}\n")


@pytest.fixture(autouse=True)
def _no_cluster(monkeypatch, tmp_path):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("DRY_RUN", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    monkeypatch.setenv("HOME", str(tmp_path))


def test_configs_directory_is_not_empty():
    assert CONFIGS, "configs/*.yaml is empty"


def _extended_by(config: str) -> list[str]:
    """Configs under configs/ that extend ``config`` (so it may be a partial base)."""
    target = (REPO / config).resolve()
    out = []
    for other in CONFIGS:
        bases = (yaml.safe_load((REPO / other).read_text()) or {}).get("extends") or []
        bases = [bases] if isinstance(bases, str) else bases
        if any(((REPO / other).parent / b).resolve() == target for b in bases):
            out.append(other)
    return out


@pytest.mark.parametrize("config", CONFIGS)
def test_every_config_renders_valid_jobs(config, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    try:
        manifests, deploy = build_manifests(str(_with_output(config, tmp_path)))
    except ConfigErrors as exc:
        users = _extended_by(config)
        if users:
            pytest.skip(f"{config} is a base extended by {users} and not runnable on its own: {exc}")
        raise
    assert_valid_kubernetes(manifests)
    assert check_manifests(manifests, deploy.node_gpus) == []
    kinds = [d["kind"] for d in manifests]
    assert kinds[0] == "ConfigMap" and kinds[-1] == "Job" and set(kinds) == {"ConfigMap", "Job"}
    mounted = yaml.safe_load(manifests[0]["data"]["train.yaml"])
    resolved = resolve_yaml(config)
    assert "extends" not in mounted and "deploy" not in mounted
    assert _without_topology(mounted) == _without_topology({k: v for k, v in resolved.items() if k != "deploy"})


# keys of the training config the chart writes from the topology (server list, server mode, weight-sync ports)
TOPOLOGY_KEYS = ("rlhf.vllm_mode", "rlhf.vllm_server_host", "rlhf.vllm_server_port", "rlhf.vllm_server_group_port",
                 "custom.extra.rollout_matching.rollout_backend", "custom.extra.rollout_matching.vllm.mode",
                 "custom.extra.rollout_matching.vllm.server.servers", "custom.extra.rollout_matching.vllm.sync.group_port")


def _without_topology(config):
    import copy

    out = copy.deepcopy(config)
    for dotted in TOPOLOGY_KEYS:
        *parents, leaf = dotted.split(".")
        node = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)

    def prune(node):
        if isinstance(node, dict):
            return {k: prune(v) for k, v in node.items() if not (isinstance(v, dict) and not prune(v))}
        return node

    return prune(out)


def _stage2_server_config(tmp_path, servers, deploy=""):
    urls = "".join(f"\n                    - base_url: http://127.0.0.1:{p}" for p in servers)
    return _write(tmp_path, "stage2_server.yaml", f"""
        extends: {TEMPLATE}
        model: {{path: /models/policy, tiny: null}}
        custom:
          extra:
            rollout_matching:
              rollout_backend: vllm
              vllm:
                mode: server
                server:
                  servers:{urls}
        {deploy}
        """)


def test_stage2_server_mode_renders_one_server_job_per_url_and_a_waiting_learner(tmp_path):
    path = _stage2_server_config(tmp_path, [8000, 8001, 8002], "deploy: {node_gpus: 4, node_name: gpu-a}")
    manifests, _ = build_manifests(str(path))
    assert_valid_kubernetes(manifests)
    servers, (learner,) = workload(manifests, "rollout-server"), workload(manifests, "learner")
    assert [flag(args_of(s), "--port") for s in servers] == ["8000", "8001", "8002"]
    assert [s["spec"]["template"]["metadata"]["annotations"]["rollout-matching/node-gpus"] for s in servers] == ["0", "1", "2"]
    assert all(flag(args_of(s), "--engine") == "vllm" and flag(args_of(s), "--model") == "/models/policy" for s in servers)
    assert learner["spec"]["template"]["metadata"]["annotations"]["rollout-matching/node-gpus"] == "3"
    assert flag(args_of(learner), "--wait-for-servers") == "http://127.0.0.1:8000,http://127.0.0.1:8001,http://127.0.0.1:8002"
    assert flag(args_of(learner), "--nproc-per-node") == "1"
    for d in manifests[1:]:
        assert pod_spec(d)["nodeSelector"] == {"kubernetes.io/hostname": "gpu-a"}
        assert pod_spec(d)["hostNetwork"] is True


def _grpo_summary_config():
    """The shape the GRPO configs use (seed 004): rlhf.* connectivity + custom.extra.rollout_server.* sizes; a
    valid config (``validate_config`` accepts it)."""
    return {
        "model": {"path": "/models/Qwen3-VL-4B"},
        "data": {"train_jsonl": "/data/summary/train.jsonl"},
        "rlhf": {"rlhf_type": "grpo", "use_vllm": True, "vllm_mode": "server",
                 "vllm_server_host": ["127.0.0.1"], "vllm_server_port": [8080], "vllm_server_timeout": 240,
                 "reward_funcs": ["summary.format"]},
        "custom": {"trainer_variant": "grpo_summary",
                   "extra": {"rollout_server": {"vllm_tensor_parallel_size": 1, "vllm_data_parallel_size": 6,
                                                "vllm_max_model_len": 8192, "vllm_gpu_memory_utilization": 0.6,
                                                "vllm_enable_lora": False}}},
    }


def test_grpo_server_mode_is_six_gpu_swift_rollout_plus_two_gpu_learner():
    config = _grpo_summary_config()
    deploy = DeployConfig(**OUTPUT)
    manifests = render_manifests(plan_topology(validate_config(config), deploy, "summary-1024"), deploy, config)
    assert_valid_kubernetes(manifests)
    assert check_manifests(manifests, 8) == []
    (server,), (learner,) = workload(manifests, "rollout-server"), workload(manifests, "learner")
    args = args_of(server)
    assert args[:2] == ["supervise", "server"] and args[args.index("--") + 1:][:2] == ["launch", "server"]
    assert (flag(args, "--engine"), flag(args, "--port"), flag(args, "--gpus")) == ("swift", "8080", "0,1,2,3,4,5")
    assert (flag(args, "--tensor-parallel-size"), flag(args, "--data-parallel-size")) == ("1", "6")
    assert (flag(args, "--max-model-len"), flag(args, "--gpu-memory-utilization")) == ("8192", "0.6")
    assert "--enable-lora" not in args
    assert pod_spec(server)["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 6
    assert pod_spec(learner)["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert flag(args_of(learner), "--wait-for-servers") == "http://127.0.0.1:8080"
    assert flag(args_of(learner), "--gpus") == "0,1"


def _stage2_servers(*ports):
    """A valid stage-2 server-mode config (the template's sections) with ``ports`` as its server list."""
    config = resolve_yaml(TEMPLATE)
    config["model"] = {"path": "/models/policy"}
    vllm = config["custom"]["extra"]["rollout_matching"].setdefault("vllm", {})
    vllm.update(mode="server", server={"servers": [{"base_url": f"http://127.0.0.1:{p}"} for p in ports]})
    config["custom"]["extra"]["rollout_matching"]["rollout_backend"] = "vllm"
    return config


@pytest.mark.parametrize(
    ("config", "patch", "key"),
    [
        ("stage2", {"custom": {"extra": {"rollout_matching": {"vllm": {"server": {"servers": [
            {"base_url": "http://10.0.0.5:8000"}]}}}}}}, "custom.extra.rollout_matching.vllm.server.servers"),
        ("stage2", {"custom": {"extra": {"rollout_matching": {"vllm": {"server": {"servers": [
            {"base_url": "http://127.0.0.1:8000"}, {"base_url": "http://127.0.0.1:8000"}]}}}}}},
         "custom.extra.rollout_matching.vllm.server.servers"),
        ("stage2", {"custom": {"extra": {"rollout_matching": {"vllm": {"server": {"servers": [
            {"base_url": "http://127.0.0.1"}]}}}}}}, "custom.extra.rollout_matching.vllm.server.servers[0].base_url"),
        ("grpo", {"deploy_node_gpus": 7}, "deploy.learner.nproc_per_node"),
        ("grpo", {"model": {"path": None, "tiny": "text"}}, "deploy.server.model"),
        ("grpo", {"deploy_engine": "vllm"}, "deploy.server.engine"),
    ],
    ids=["remote-host", "duplicate-port", "no-port", "too-few-gpus", "no-model", "dp-needs-swift"],
)
def test_topology_errors_name_the_key(config, patch, key):
    from trainer.config.errors import ConfigError
    from trainer.config.loader import deep_merge

    patch = dict(patch)
    node_gpus = patch.pop("deploy_node_gpus", 8)
    engine = patch.pop("deploy_engine", "auto")
    base = _stage2_servers(8000) if config == "stage2" else _grpo_summary_config()
    typed = validate_config(deep_merge(base, patch))
    deploy = DeployConfig(**OUTPUT, node_gpus=node_gpus, learner={"nproc_per_node": 2}, server={"engine": engine})
    with pytest.raises(ConfigError) as err:
        plan_topology(typed, deploy, "x")
    assert err.value.key_path == key


@pytest.mark.parametrize(
    ("patch", "key", "needle"),
    [
        ({"rlhf": {"vllm_server_host": ["10.0.0.5"]}}, "rlhf.vllm_server_host", "requires local hosts"),
        ({"rlhf": {"vllm_server_port": [8080, 8080], "vllm_server_host": ["127.0.0.1"]}}, "rlhf.vllm_server_port",
         "give one port per host"),
        ({"rlhf": {"vllm_server_port": [8080, 8080], "vllm_server_host": ["127.0.0.1", "127.0.0.1"]}},
         "rlhf.vllm_server_host", "one rollout server"),
        ({"model": {"path": None}}, "model", "set exactly one of model.path"),
    ],
    ids=["remote-host", "port-without-host", "duplicate-port", "no-model"],
)
def test_grpo_topology_errors_the_schema_catches_first_name_the_key(patch, key, needle):
    """GRPO server lists the node cannot run are refused by the schema (``check_grpo``) before any planning; the
    error still names the key to change."""
    from trainer.config.loader import deep_merge

    with pytest.raises(ConfigErrors) as err:
        validate_config(deep_merge(_grpo_summary_config(), patch))
    assert any(e.key_path == key and needle in e.message for e in err.value.errors), err.value


def test_bad_deploy_section_is_reported_with_key_paths(tmp_path, capsys):
    path = _stage2_server_config(tmp_path, [8000], "deploy: {imagez: {}, learner: {gpus: [0]}, namespace: Bad_NS}")
    assert main(["render-job", "--config", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "deploy.imagez" in err and "deploy.namespace" in err


def test_overlapping_learner_gpus_are_refused(tmp_path, capsys):
    path = _stage2_server_config(tmp_path, [8000, 8001], "deploy: {learner: {gpus: [1]}}")
    assert main(["render-job", "--config", str(path), "--dry-run"]) == 2
    assert "deploy.learner.gpus: GPU(s) [1] are also rollout-server GPUs" in capsys.readouterr().err


def test_invalid_training_config_is_reported_before_rendering(tmp_path, capsys):
    path = _write(tmp_path, "typo.yaml", f"""
        extends: {TEMPLATE}
        training: {{pakcing: true}}
        """)
    assert main(["render-job", "--config", str(path), "--dry-run"]) == 2
    assert "training.pakcing" in capsys.readouterr().err


@pytest.mark.parametrize("how", ["env", "flag"])
def test_dry_run_prints_the_manifests_as_yaml(how, tmp_path, monkeypatch, capsys):
    path = _stage2_server_config(tmp_path, [8000, 8001])
    argv = ["render-job", "--config", str(path)]
    if how == "env":
        monkeypatch.setenv("DRY_RUN", "1")
    else:
        argv.append("--dry-run")
    assert main(argv) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [(d["kind"], d["metadata"]["name"]) for d in docs] == [
        ("ConfigMap", "stage2-server-config"), ("Job", "stage2-server-server-0"), ("Job", "stage2-server-server-1"),
        ("Job", "stage2-server-learner")]
    assert_valid_kubernetes(docs)


def test_missing_cluster_credentials_give_a_clear_error(tmp_path, capsys):
    path = _stage2_server_config(tmp_path, [8000])
    assert main(["render-job", "--config", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "no Kubernetes credentials" in captured.err
    assert "KUBECONFIG" in captured.err and "DRY_RUN=1" in captured.err


def test_submission_creates_configmap_then_servers_then_learner(tmp_path, monkeypatch, capsys):
    created = []
    monkeypatch.setattr(submit_mod, "_client", lambda: "api-client")
    import kubernetes.utils

    monkeypatch.setattr(kubernetes.utils, "create_from_dict",
                        lambda api, doc, namespace: created.append((api, namespace, doc["kind"], doc["metadata"]["name"])))
    path = _stage2_server_config(tmp_path, [8000, 8001], "deploy: {namespace: training}")
    assert main(["render-job", "--config", str(path)]) == 0
    assert created == [("api-client", "training", "ConfigMap", "stage2-server-config"),
                       ("api-client", "training", "Job", "stage2-server-server-0"),
                       ("api-client", "training", "Job", "stage2-server-server-1"),
                       ("api-client", "training", "Job", "stage2-server-learner")]
    assert "created Job/stage2-server-learner in namespace training" in capsys.readouterr().out


def test_submission_conflict_says_how_to_clean_up(tmp_path, monkeypatch, capsys):
    import kubernetes.utils
    from kubernetes.client.exceptions import ApiException

    monkeypatch.setattr(submit_mod, "_client", lambda: "api-client")

    def conflict(api, doc, namespace):
        raise kubernetes.utils.FailToCreateError([ApiException(status=409, reason="AlreadyExists")])

    monkeypatch.setattr(kubernetes.utils, "create_from_dict", conflict)
    path = _stage2_server_config(tmp_path, [8000])
    assert main(["render-job", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert "409 AlreadyExists" in err and "kubectl delete jobs,configmaps -l rollout-matching/run=stage2-server" in err


def test_values_are_escaped_not_interpolated():
    config = _grpo_summary_config()
    tricky = 'a: "b"\n- c # {{ not jinja }}'
    deploy = DeployConfig(**OUTPUT, env={"TRICKY": tricky}, server={"extra_args": ["--flag", tricky]})
    manifests = render_manifests(plan_topology(validate_config(config), deploy, "x"), deploy, config)
    again = list(yaml.safe_load_all(to_yaml(manifests)))
    (server,) = workload(again, "rollout-server")
    env = {e["name"]: e["value"] for e in pod_spec(server)["containers"][0]["env"]}
    assert env["TRICKY"] == tricky
    assert args_of(server)[-2:] == ["--flag", tricky]


def test_render_job_refuses_a_config_without_an_output_volume(tmp_path, capsys):
    path = tmp_path / "no-output.yaml"
    path.write_text(f"extends: {TEMPLATE}\n")
    assert main(["render-job", "--config", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "deploy.output_host_path: the learner's checkpoints need a volume that outlives the pod" in err
    assert "Traceback" not in err
    path.write_text(f"extends: {TEMPLATE}\ndeploy: {{values: {{storage: {{output: {{claimName: runs}}}}}}}}\n")
    manifests, _ = build_manifests(str(path))
    (learner,) = workload(manifests, "learner")
    (output,) = [v for v in pod_spec(learner)["volumes"] if v["name"] == "output"]
    assert output["persistentVolumeClaim"] == {"claimName": "runs"}
    assert flag(args_of(learner), "--resume") == "auto"


def test_config_errors_are_config_errors(tmp_path):
    with pytest.raises(ConfigErrors):
        build_manifests(str(tmp_path / "missing.yaml"))


def test_summary_1024_is_six_gpu_swift_server_and_two_gpu_learner():
    config = resolve_yaml(REPO / "configs" / "summary_1024.yaml")
    deploy = DeployConfig.model_validate({**(config.get("deploy") or {}), **OUTPUT})
    topology = plan_topology(validate_config(config), deploy, "summary-1024")
    manifests = render_manifests(topology, deploy, config)
    assert_valid_kubernetes(manifests)
    assert check_manifests(manifests, deploy.node_gpus) == []
    (server,), (learner,) = workload(manifests, "rollout-server"), workload(manifests, "learner")
    assert (flag(args_of(server), "--engine"), flag(args_of(server), "--data-parallel-size")) == ("swift", "6")
    assert pod_spec(server)["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 6
    assert pod_spec(learner)["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert flag(args_of(learner), "--wait-for-servers") == server_url(server)
    assert "--resume" not in args_of(learner), "swift rlhf (GRPO) has no exact resume: the chart leaves it out"


def server_url(server):
    return f"http://{flag(args_of(server), '--host')}:{flag(args_of(server), '--port')}"


#: the shipped configs meant for `make job CONFIG=…`: the summary GRPO configs (summary_base.yaml is their base)
MAKE_JOB_CONFIGS = [c for c in CONFIGS if c.startswith("configs/summary_") and not c.endswith("_base.yaml")]


def test_every_shipped_config_the_docs_pass_to_make_job_is_checked():
    import re

    pages = [*sorted((REPO / "docs").rglob("*.md")), REPO / "mk" / "deploy.mk"]
    named = {m for page in pages for m in re.findall(r"make job CONFIG=(configs/[\w.-]+\.yaml)", page.read_text())}
    shipped = {c for c in named if (REPO / c).is_file()}
    assert "configs/summary_1024.yaml" in shipped
    assert shipped <= set(MAKE_JOB_CONFIGS), sorted(shipped - set(MAKE_JOB_CONFIGS))


@pytest.mark.parametrize("config", MAKE_JOB_CONFIGS)
def test_make_job_renders_a_shipped_config_as_it_is(config, monkeypatch, capsys):
    """What ``DRY_RUN=1 make job CONFIG=<config>`` runs (``render-job --config <config>``, from the repository
    root), with no output volume added by the test: the config names its own."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("DRY_RUN", "1")
    assert main(["render-job", "--config", config]) == 0, capsys.readouterr().err
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert_valid_kubernetes(docs)
    (learner,) = workload(docs, "learner")
    (output,) = [v for v in pod_spec(learner)["volumes"] if v["name"] == "output"]
    assert output["hostPath"]["path"] == "/data/runs"


def _learner_job(workload_kind, tmp_path, deploy=""):
    """The learner Job of a stage-2 config with one rollout server, or of configs/summary_1024.yaml."""
    if workload_kind == "stage2":
        path = _stage2_server_config(tmp_path, [8000], deploy)
    else:
        path = _write(tmp_path, "grpo.yaml", f"extends: {(REPO / 'configs/summary_1024.yaml').as_posix()}\n{deploy}\n")
    (learner,) = workload(build_manifests(str(path))[0], "learner")
    return learner


@pytest.mark.parametrize(("kind", "resumes"), [("stage2", True), ("grpo", False)])
def test_render_job_retries_a_failed_learner_as_the_chart_does(kind, resumes, tmp_path, monkeypatch):
    """The learner Job's ``backoffLimit`` is the chart's ``learner.backoffLimit`` (2) for both workloads; a stage-2
    retry resumes (``--resume auto``), a GRPO one starts over (the chart does the same). With retries left the
    learner's supervisor does not take a failure as final (the servers wait for the retry); ``backoff_limit: 0``
    makes it final."""
    from trainer.deploy.render import chart_defaults

    monkeypatch.chdir(REPO)
    assert chart_defaults()["learner"]["backoffLimit"] == DeployConfig().learner.backoff_limit == 2
    learner = _learner_job(kind, tmp_path)
    args = args_of(learner)
    assert learner["spec"]["backoffLimit"] == 2
    assert args[:2] == ["supervise", "learner"] and "--final-on-failure" not in args
    assert (flag(args, "--resume") == "auto") if resumes else ("--resume" not in args)
    final = _learner_job(kind, tmp_path, "deploy: {learner: {backoff_limit: 0}}")
    assert final["spec"]["backoffLimit"] == 0 and "--final-on-failure" in args_of(final)
