"""The Helm chart, linted and rendered with Helm's Go SDK for the defaults and every topology file."""

from __future__ import annotations

import pytest
from deploy_helpers import (
    ALL_VALUES,
    CHART,
    REPO,
    TOPOLOGY_FILES,
    args_of,
    assert_lint_clean,
    assert_valid_kubernetes,
    flag,
    helm,
    load_values,
    manifests_of,
    node_gpus,
    pod_spec,
    render_chart,
    render_docs,
    train_yaml,
    workload,
)

from trainer.config.schema import validate_config
from trainer.deploy.checks import check_manifests

# values file -> (rollout servers, learner GPUs)
EXPECTED_SHAPE = {None: (1, 1), "presets/6v2-2b-full.values.yaml": (6, 2), "presets/3v1-2b-full.values.yaml": (3, 1), "presets/colocate-4-2b-full.values.yaml": (0, 4)}


@pytest.mark.parametrize("values_file", ALL_VALUES)
def test_lint_is_clean(values_file):
    assert_lint_clean(load_values(values_file))


@pytest.mark.parametrize("values_file", ALL_VALUES)
def test_every_rendered_manifest_validates(values_file):
    _, docs = render_docs(values_file)
    assert {d["kind"] for d in docs} >= {"ConfigMap", "Job", "Pod"}
    assert_valid_kubernetes(docs)


@pytest.mark.parametrize("values_file", ALL_VALUES)
def test_topology_is_coherent(values_file):
    values, docs = render_docs(values_file)
    gpus = node_gpus(values)
    assert check_manifests(docs, gpus) == []
    n_servers, learner_gpus = EXPECTED_SHAPE[values_file]
    servers = workload(docs, "rollout-server")
    (learner,) = workload(docs, "learner")
    assert len(servers) == n_servers
    assert flag(args_of(learner), "--nproc-per-node") == str(learner_gpus)
    gpu_total = sum(pod_spec(d)["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] for d in [*servers, learner])
    assert gpu_total == n_servers + learner_gpus <= min(gpus, 8)
    ports = [flag(args_of(s), "--port") for s in servers]
    assert len(set(ports)) == len(ports)
    for s in servers:
        assert flag(args_of(s), "--host") == "127.0.0.1"
        # servers are Jobs: a crash restarts the container in place; a server stopped when the learner ends completes
        assert s["kind"] == "Job" and pod_spec(s)["restartPolicy"] == "OnFailure"
    for d in [*servers, learner]:
        spec = pod_spec(d)
        assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
        assert spec["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True


@pytest.mark.parametrize("values_file", ALL_VALUES)
def test_learner_waits_for_every_server_and_config_lists_them(values_file):
    _, docs = render_docs(values_file)
    urls = [f"http://127.0.0.1:{flag(args_of(s), '--port')}" for s in workload(docs, "rollout-server")]
    (learner,) = workload(docs, "learner")
    args = args_of(learner)
    cfg = train_yaml(docs)
    if urls:
        assert flag(args, "--wait-for-servers").split(",") == urls
        assert float(flag(args, "--health-timeout-s")) > 0
        assert [s["base_url"] for s in cfg["custom"]["extra"]["rollout_matching"]["vllm"]["server"]["servers"]] == urls
    else:
        assert "--wait-for-servers" not in args
        assert cfg["custom"]["extra"]["rollout_matching"]["vllm"]["mode"] == "colocate"


@pytest.mark.parametrize("values_file", ["presets/6v2-2b-full.values.yaml", "presets/3v1-2b-full.values.yaml"])
def test_server_topologies_ship_async_rollouts_beside_the_written_server_list(values_file):
    """The server layouts we ship overlap decode and training (sync ping-pong measured at 0.97x one GPU on two); the
    chart's topology patch deep-merges the server list into ``vllm.server`` and keeps ``async_rollouts``."""
    _, docs = render_docs(values_file)
    server = train_yaml(docs)["custom"]["extra"]["rollout_matching"]["vllm"]["server"]
    assert server["async_rollouts"] == {"enabled": True, "max_staleness_steps": 1}
    assert len(server["servers"]) == len(workload(docs, "rollout-server")) >= 1
    cfg = validate_config(train_yaml(docs), source=values_file)
    assert cfg.custom.extra.rollout_matching.vllm.server.async_rollouts.enabled


@pytest.mark.parametrize("values_file", TOPOLOGY_FILES)
def test_shipped_topologies_size_checkpointing_and_compile_the_learner(values_file):
    """Every topology we ship runs the learner measured fastest in ``benchmarks/layouts.yaml``: checkpointing sized
    from the GPU's memory (no OOM where it does not fit, no recompute where it does) and compiled decoder layers."""
    _, docs = render_docs(values_file)
    cfg = validate_config(train_yaml(docs), source=values_file)
    assert cfg.training.checkpointing_policy == "auto"
    assert cfg.training.compile_decoder_layers and not cfg.training.use_liger_kernel


def test_the_colocate_topology_ships_the_engine_levers_it_ran_with():
    """``presets/colocate-4-2b-full.values.yaml``'s engine: level-2 sleep, the training pixels made during the decode and the recorded
    load (``python -m trainer bench run benchmarks/layouts.yaml --only colocate-2-r128-pixels-auto-compile-recload``
    on 2 x H200, 2026-11-28)."""
    _, docs = render_docs("presets/colocate-4-2b-full.values.yaml")
    v = validate_config(train_yaml(docs), source="presets/colocate-4-2b-full.values.yaml").rollout_matching.vllm
    assert v.mode == "colocate" and v.sleep_level == 2 and v.pixels_during_decode and v.sync.recorded_load
    assert not v.sync.merge_into_engine, "a full fine-tune has no LoRA merge to write into the engine"


@pytest.mark.parametrize("values_file", ALL_VALUES)
def test_mounted_training_config_passes_the_trainer_schema(values_file):
    _, docs = render_docs(values_file)
    validate_config(train_yaml(docs), source=f"ConfigMap of {values_file or 'chart defaults'}")


@pytest.mark.parametrize("values_file", ALL_VALUES)
def test_helm_test_hook_checks_every_server(values_file):
    _, docs = render_docs(values_file)
    (hook,) = [d for d in docs if d["kind"] == "Pod"]
    assert hook["metadata"]["annotations"]["helm.sh/hook"] == "test"
    urls = [f"http://127.0.0.1:{flag(args_of(s), '--port')}" for s in workload(docs, "rollout-server")]
    args = args_of(hook)
    assert flag(args, "--config") == "/etc/rollout-matching/train.yaml"
    if urls:
        assert flag(args, "--servers").split(",") == urls


def test_topology_files_live_only_at_the_repository_root():
    assert all((REPO / f).is_file() for f in TOPOLOGY_FILES)
    assert not list(CHART.glob("values-*.yaml"))


def test_grpo_config_gets_the_server_list_in_its_rlhf_section():
    values = load_values("presets/6v2-2b-full.values.yaml")
    values["rolloutServer"].update(engine="swift", instances=[{"port": 8080, "gpus": [0, 1, 2, 3, 4, 5]}],
                                   dataParallelSize=6)
    values["learner"]["config"] = {"rlhf": {"rlhf_type": "grpo", "use_vllm": True}, "model": {"path": "/models/policy"}}
    docs = manifests_of(render_chart(values))
    assert check_manifests(docs, 8) == []
    cfg = train_yaml(docs)
    assert cfg["rlhf"]["vllm_mode"] == "server"
    assert cfg["rlhf"]["vllm_server_host"] == ["127.0.0.1"] and cfg["rlhf"]["vllm_server_port"] == [8080]
    assert cfg["custom"]["extra"]["rollout_server"]["vllm_data_parallel_size"] == 6
    (server,) = workload(docs, "rollout-server")
    assert flag(args_of(server), "--engine") == "swift"
    assert flag(args_of(server), "--gpus") == "0,1,2,3,4,5"


def test_visible_devices_mode_pins_physical_ids_without_resource_requests():
    values = load_values("presets/6v2-2b-full.values.yaml")
    values["gpu"] = {"assignment": "visibleDevices", "resourceName": "nvidia.com/gpu"}
    docs = manifests_of(render_chart(values))
    assert check_manifests(docs, 8) == []
    (learner,) = workload(docs, "learner")
    container = pod_spec(learner)["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "6,7" and env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})


def test_node_name_pins_every_pod():
    _, docs = render_docs("presets/3v1-2b-full.values.yaml", {"node": {"name": "gpu-node-7", "gpuCount": 4}})
    for d in [*workload(docs, "rollout-server"), *workload(docs, "learner"), *[x for x in docs if x["kind"] == "Pod"]]:
        assert pod_spec(d)["nodeSelector"]["kubernetes.io/hostname"] == "gpu-node-7"


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda docs: _set_arg(workload(docs, "rollout-server")[1], "--port", flag(args_of(workload(docs, "rollout-server")[0]), "--port")),
         "is used by another server"),
        (lambda docs: workload(docs, "learner")[0]["spec"]["template"]["metadata"]["annotations"].update({"rollout-matching/node-gpus": "0,7"}),
         "GPU 0 is also used by"),
        (lambda docs: pod_spec(workload(docs, "rollout-server")[2])["containers"][0]["readinessProbe"]["httpGet"].update(path="/healthz"),
         "is not served"),
        (lambda docs: _set_arg(workload(docs, "learner")[0], "--wait-for-servers", "http://127.0.0.1:8000"),
         "--wait-for-servers"),
        (lambda docs: pod_spec(workload(docs, "learner")[0]).update(hostNetwork=False), "hostNetwork must be true"),
        (lambda docs: pod_spec(workload(docs, "rollout-server")[0])["containers"][0]["resources"]["limits"].update({"nvidia.com/gpu": 2}),
         "requests 2 nvidia.com/gpu"),
    ],
    ids=["duplicate-port", "shared-gpu", "probe-path", "learner-misses-servers", "no-host-network", "gpu-count"],
)
def test_semantic_checks_catch_broken_manifests(mutate, expected):
    _, docs = render_docs("presets/6v2-2b-full.values.yaml")
    mutate(docs)
    problems = check_manifests(docs, 8)
    assert any(expected in p for p in problems), problems


def _set_arg(doc, name, value):
    args = pod_spec(doc)["containers"][0]["args"]
    args[args.index(name) + 1] = value


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"rolloutServer": {"instances": [{"port": 70000, "gpus": [0]}]}}, "/rolloutServer/instances/0/port"),
        ({"rolloutServer": {"engine": "sglang"}}, "/rolloutServer/engine"),
        ({"rolloutServer": {"host": "0.0.0.0"}}, "/rolloutServer/host"),
        ({"learner": {"gpus": [1, 1]}}, "/learner/gpus"),
        ({"rolloutServer": {"instances": [{"port": 8000, "gpu": [0]}]}}, "'gpu' not allowed"),
        ({"gpu": {"assignment": "mig"}}, "/gpu/assignment"),
        ({"securityContext": {"runAsUser": 0}}, "/securityContext/runAsUser"),
        ({"learner": {"config": None}}, "config"),
    ],
    ids=["port-range", "engine", "host", "duplicate-gpu", "typo", "assignment", "root", "no-config"],
)
def test_schema_rejects_bad_values_naming_the_key(values, expected):
    with pytest.raises(helm.HelmValuesError) as err:
        render_chart(values)
    assert expected in str(err.value)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"rolloutServer": {"instances": [{"port": 8000, "gpus": [0]}, {"port": 8000, "gpus": [2]}]}},
         "rolloutServer.instances[1]: port 8000 is already used by rolloutServer.instances[0]"),
        ({"learner": {"gpus": [0]}}, "learner.gpus: GPU 0 is already assigned to rolloutServer.instances[0]"),
        ({"rolloutServer": {"instances": [{"port": 8000, "gpus": [0, 1]}]}}, "tensorParallelSize × dataParallelSize = 1"),
        ({"learner": {"nprocPerNode": 2}}, "learner.nprocPerNode is 2 but learner.gpus lists 1"),
        ({"node": {"gpuCount": 1}}, "does not exist on a node with node.gpuCount=1"),
        ({"rolloutServer": {"model": ""}}, "rolloutServer.model is empty"),
        ({"rolloutServer": {"dataParallelSize": 2, "instances": [{"port": 8000, "gpus": [0, 2]}]}},
         "rolloutServer.dataParallelSize is 2 but engine vllm runs one engine per server"),
    ],
    ids=["port", "overlap", "tp-dp", "nproc", "gpu-count", "model", "dp-needs-swift"],
)
def test_topology_rules_fail_the_render_with_guidance(values, expected):
    with pytest.raises(helm.HelmRenderError) as err:
        render_chart(values)
    assert expected in str(err.value)


def test_learner_works_in_the_writable_output_volume():
    _, docs = render_docs("presets/6v2-2b-full.values.yaml")
    (learner,) = workload(docs, "learner")
    container = pod_spec(learner)["containers"][0]
    assert container["workingDir"] == "/output"
    container["workingDir"] = "/app"
    assert any("workingDir /app is not a writable volume" in p for p in check_manifests(docs, 8))
