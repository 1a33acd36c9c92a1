"""The chart's production options: per-pod port blocks, shared caches and volumes, the NCCL block,
scheduling (priorityClassName, PDB, ttlSecondsAfterFinished, Kueue, JobSet) and the server lifecycle; every
topology rendered with each option on and off, validated against the Kubernetes schemas and the semantic checks."""

from __future__ import annotations

import re

import pytest
import yaml
from deploy_helpers import (
    ALL_VALUES,
    CHART,
    REPO,
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

from trainer.config.loader import deep_merge
from trainer.deploy.checks import check_manifests, check_ports, port_claims

OPTIONS = {
    "defaults": {},
    "caches-hostpath": {"caches": {"hostPath": "/var/cache/rollout-matching"}},
    "caches-pvc+models-pvc": {"caches": {"claimName": "compile-cache"},
                              "storage": {"models": {"hostPath": "", "claimName": "models"},
                                          "output": {"claimName": "runs"}}},
    "extra-volume": {"storage": {"extraVolumes": [{"name": "tokenizers", "hostPath": "/data/tok", "mountPath": "/tok"}]}},
    "no-lifecycle": {"lifecycle": {"enabled": False}},
    "scheduling": {"priorityClassName": "training-high", "jobs": {"ttlSecondsAfterFinished": 86400},
                   "podDisruptionBudget": {"enabled": True}},
    "kueue": {"gang": {"queueName": "gpu-queue"}},
    "jobset": {"gang": {"queueName": "gpu-queue", "jobSet": {"enabled": True, "maxRestarts": 2}}},
    "other-ports": {"ports": {"base": 12000, "blockSize": 250}},
    "metrics": {"metrics": {"enabled": True, "learnerPort": 9400,
                            "podMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}}},
    "nccl-multinode": {"nccl": {"hostIPC": True, "env": {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_DISABLE": "0"}}},
}


def _render(values_file, option):
    return render_docs(values_file, OPTIONS[option])


def _gpu_pods(docs):
    """(name, component, pod spec) of every server and learner pod, Jobs or JobSet alike."""
    out = []
    for d in docs:
        if d["kind"] == "Job":
            out.append((d["metadata"]["name"], d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"],
                        d["spec"]["template"]))
        elif d["kind"] == "JobSet":
            for rj in d["spec"]["replicatedJobs"]:
                tpl = rj["template"]["spec"]["template"]
                out.append((rj["name"], tpl["metadata"]["labels"]["app.kubernetes.io/component"], tpl))
    return out


def _env(pod):
    return {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}


def _validate(docs):
    """Built-in kinds against the Kubernetes schemas; a JobSet's Jobs as Jobs (the CRD schema is not shipped); a
    PodMonitor (CRD, not shipped either) by ``_check_pod_monitor``."""
    builtin = [d for d in docs if d["kind"] not in ("JobSet", "PodMonitor")]
    for d in docs:
        if d["kind"] == "PodMonitor":
            _check_pod_monitor(d)
    for d in docs:
        if d["kind"] == "JobSet":
            builtin += [{"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": rj["name"], **rj["template"].get("metadata", {})},
                         "spec": rj["template"]["spec"]} for rj in d["spec"]["replicatedJobs"]]
    assert_valid_kubernetes(builtin)


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("values_file", ALL_VALUES)
def test_every_topology_with_every_option_lints_validates_and_is_coherent(values_file, option):
    values, docs = _render(values_file, option)
    assert_lint_clean(values)
    _validate(docs)
    assert check_manifests(docs, node_gpus(values)) == []


# --- ports ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("option", ["defaults", "other-ports", "jobset", "no-lifecycle", "metrics"])
@pytest.mark.parametrize("values_file", ALL_VALUES)
def test_every_port_any_pod_can_open_is_distinct_across_the_release(values_file, option):
    values, docs = _render(values_file, option)
    claims = port_claims(docs)
    pods = _gpu_pods(docs)
    n_servers = sum(c == "rollout-server" for _, c, _ in pods)
    # every pod claims something; every server its HTTP port, rendezvous and vLLM's range; the learner its group ports
    assert {c.owner for c in claims} == {f"{'JobSet' if option == 'jobset' else 'Job'} {n}" if option != "jobset" else
                                         f"JobSet {docs_name(docs)}/{n}" for n, _, _ in pods}
    assert sum(c.what == "HTTP --port" for c in claims) == n_servers
    assert sum(c.what == "weight-sync group port" for c in claims) == n_servers
    assert sum(c.what.startswith("VLLM_PORT") for c in claims) == n_servers + 1
    ordered = sorted(claims, key=lambda c: c.first)
    for a, b in zip(ordered, ordered[1:]):
        assert a.last < b.first, f"{a} overlaps {b}"
    assert check_ports(docs) == []


def docs_name(docs):
    (jobset,) = [d for d in docs if d["kind"] == "JobSet"]
    return jobset["metadata"]["name"]


def test_port_blocks_follow_the_instance_index():
    _, docs = _render("presets/6v2-2b-full.values.yaml", "other-ports")
    servers = workload(docs, "rollout-server")
    for i, s in enumerate(servers):
        first = 12000 + i * 250
        assert s["spec"]["template"]["metadata"]["annotations"]["rollout-matching/ports"] == f"{first}-{first + 249}"
        env = _env(s["spec"]["template"])
        assert (env["VLLM_DP_MASTER_PORT"], env["VLLM_PORT"]) == (str(first), str(first + 1))
    (learner,) = workload(docs, "learner")
    first = 12000 + 6 * 250
    env = _env(learner["spec"]["template"])
    assert env["MASTER_PORT"] == env["PET_MASTER_PORT"] == str(first) and env["VLLM_PORT"] == str(first + 50)
    assert flag(args_of(learner), "--control-port") == str(first + 1)
    cfg = train_yaml(docs)
    assert cfg["custom"]["extra"]["rollout_matching"]["vllm"]["sync"]["group_port"] == first + 2
    for s in servers:
        assert flag(args_of(s), "--learner-control") == f"http://127.0.0.1:{first + 1}"


def test_grpo_group_ports_are_one_per_server_in_the_learner_block():
    values = load_values("presets/6v2-2b-full.values.yaml")
    values["rolloutServer"].update(engine="swift", instances=[{"port": 8080, "gpus": [0, 1, 2]}, {"port": 8081, "gpus": [3, 4, 5]}],
                                   dataParallelSize=3, gpuMemoryUtilization=None)
    values["learner"]["config"] = {"rlhf": {"rlhf_type": "grpo"}, "model": {"path": "/models/policy"}}
    docs = manifests_of(render_chart(values))
    assert check_manifests(docs, 8) == []
    cfg = train_yaml(docs)
    assert cfg["rlhf"]["vllm_server_group_port"] == [20202, 20203]
    assert "vllm_gpu_memory_utilization" not in cfg["custom"]["extra"]["rollout_server"]
    assert all("--gpu-memory-utilization" not in args_of(s) for s in workload(docs, "rollout-server"))


@pytest.mark.parametrize(("mutate", "expected"), [
    (lambda docs: _set_env(workload(docs, "rollout-server")[1], "VLLM_PORT", "20001"), "port collision"),
    (lambda docs: _set_env(workload(docs, "learner")[0], "MASTER_PORT", "8003"), "port collision"),
    (lambda docs: _set_env(workload(docs, "rollout-server")[0], "VLLM_DP_MASTER_PORT", "20150"), "outside its port block"),
    (lambda docs: _set_group_port(docs, 20005), "port collision"),
], ids=["vllm-ranges-overlap", "master-port-on-http-port", "outside-block", "group-port-in-server-block"])
def test_port_check_catches_collisions(mutate, expected):
    _, docs = _render("presets/6v2-2b-full.values.yaml", "defaults")
    mutate(docs)
    problems = check_manifests(docs, 8)
    assert any(expected in p for p in problems), problems


def _set_env(doc, name, value):
    for e in pod_spec(doc)["containers"][0]["env"]:
        if e["name"] == name:
            e["value"] = value


def _set_group_port(docs, port):
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    cfg = yaml.safe_load(cm["data"]["train.yaml"])
    cfg["custom"]["extra"]["rollout_matching"]["vllm"]["sync"]["group_port"] = port
    cm["data"]["train.yaml"] = yaml.safe_dump(cfg)


@pytest.mark.parametrize(("values", "expected"), [
    ({"rolloutServer": {"instances": [{"port": 20050, "gpus": [0]}]}},
     "rolloutServer.instances[0]: port 20050 lies in the internal port blocks 20000-20199"),
    ({"ports": {"base": 65000, "blockSize": 400}}, "ends past 65535"),
], ids=["http-port-in-a-block", "past-65535"])
def test_port_rules_fail_the_render(values, expected):
    with pytest.raises(helm.HelmRenderError) as err:
        render_chart(values)
    assert expected in str(err.value)


def test_port_schema_rejects_small_blocks():
    with pytest.raises(helm.HelmValuesError) as err:
        render_chart({"ports": {"base": 20000, "blockSize": 10}})
    assert "/ports/blockSize" in str(err.value)


# --- caches and volumes -----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("option", "source"), [
    ("defaults", {"emptyDir": {}}),
    ("caches-hostpath", {"hostPath": {"path": "/var/cache/rollout-matching", "type": "Directory"}}),
    ("caches-pvc+models-pvc", {"persistentVolumeClaim": {"claimName": "compile-cache"}}),
])
def test_compile_caches_are_one_volume_shared_by_every_pod(option, source):
    _, docs = _render("presets/6v2-2b-full.values.yaml", option)
    pods = _gpu_pods(docs)
    assert len(pods) == 7
    for name, _, pod in pods:
        (vol,) = [v for v in pod["spec"]["volumes"] if v["name"] == "compile-cache"]
        assert {k: v for k, v in vol.items() if k != "name"} == source, name
        (mount,) = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "compile-cache"]
        assert mount["mountPath"] == "/cache" and not mount.get("readOnly")
        env = _env(pod)
        assert (env["VLLM_CACHE_ROOT"], env["TRITON_CACHE_DIR"], env["TORCHINDUCTOR_CACHE_DIR"]) == (
            "/cache/vllm", "/cache/triton", "/cache/inductor")


def test_models_volume_is_read_only_and_the_same_for_every_pod():
    for option, source in [("defaults", {"hostPath": {"path": "/data/models", "type": "Directory"}}),
                           ("caches-pvc+models-pvc", {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}})]:
        _, docs = _render("presets/6v2-2b-full.values.yaml", option)
        for name, _, pod in _gpu_pods(docs):
            (vol,) = [v for v in pod["spec"]["volumes"] if v["name"] == "models"]
            assert {k: v for k, v in vol.items() if k != "name"} == source, name
            (mount,) = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "models"]
            assert mount == {"name": "models", "mountPath": "/models", "readOnly": True}
    (learner,) = workload(_render("presets/6v2-2b-full.values.yaml", "caches-pvc+models-pvc")[1], "learner")
    (output,) = [v for v in pod_spec(learner)["volumes"] if v["name"] == "output"]
    assert output["persistentVolumeClaim"] == {"claimName": "runs"}


def test_extra_volumes_and_disabled_dataset():
    values = deep_merge(load_values("presets/3v1-2b-full.values.yaml"), OPTIONS["extra-volume"])
    values["storage"]["data"] = {"enabled": False, "hostPath": "", "mountPath": "/data"}
    for name, _, pod in _gpu_pods(manifests_of(render_chart(values))):
        names = [v["name"] for v in pod["spec"]["volumes"]]
        assert "tokenizers" in names and "data" not in names, name
        (mount,) = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "tokenizers"]
        assert mount["readOnly"] is True and mount["mountPath"] == "/tok"


# --- NCCL -------------------------------------------------------------------------------------------------------

def _nccl_defaults():
    with helm.Chart.load(str(CHART)) as chart:
        return chart.values["nccl"]["env"]


def test_nccl_block_reaches_every_pod_and_each_variable_is_documented():
    defaults = _nccl_defaults()
    assert {"NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_SHM_DISABLE"} <= set(defaults)
    _, docs = _render("presets/6v2-2b-full.values.yaml", "defaults")
    for name, _, pod in _gpu_pods(docs):
        env = _env(pod)
        assert {k: env[k] for k in defaults} == {k: str(v) for k, v in defaults.items()}, name
    guide = (REPO / "docs" / "guides" / "deployment.md").read_text()
    section = guide[guide.index("### NCCL"):]
    for key in defaults:
        assert re.search(rf"`{key}`[^\n]*\|[^\n]*\|", section), f"{key} has no row (what it is for, when to change) in docs/guides/deployment.md"


def test_nccl_values_override_the_defaults():
    _, docs = _render("presets/3v1-2b-full.values.yaml", "nccl-multinode")
    for _, _, pod in _gpu_pods(docs):
        env = _env(pod)
        assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["NCCL_IB_DISABLE"] == "0" and env["NCCL_CUMEM_ENABLE"] == "0"
        assert pod["spec"]["hostIPC"] is True


# --- scheduling -------------------------------------------------------------------------------------------------

def test_scheduling_options_off_by_default():
    _, docs = _render("presets/6v2-2b-full.values.yaml", "defaults")
    assert not [d for d in docs if d["kind"] in ("PodDisruptionBudget", "JobSet")]
    for d in [d for d in docs if d["kind"] == "Job"]:
        assert "ttlSecondsAfterFinished" not in d["spec"] and "suspend" not in d["spec"]
        assert "kueue.x-k8s.io/queue-name" not in d["metadata"]["labels"]
        assert "priorityClassName" not in pod_spec(d)


def test_priority_class_ttl_and_pdb():
    _, docs = _render("presets/6v2-2b-full.values.yaml", "scheduling")
    jobs = [d for d in docs if d["kind"] == "Job"]
    assert len(jobs) == 7
    for d in jobs:
        assert pod_spec(d)["priorityClassName"] == "training-high"
        assert d["spec"]["ttlSecondsAfterFinished"] == 86400
    (pdb,) = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["minAvailable"] == 7
    sel = pdb["spec"]["selector"]
    for d in jobs:
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in sel["matchLabels"].items())
        assert labels["app.kubernetes.io/component"] in sel["matchExpressions"][0]["values"]
    (hook,) = [d for d in docs if d["kind"] == "Pod"]
    assert hook["metadata"]["labels"]["app.kubernetes.io/component"] not in sel["matchExpressions"][0]["values"]


def test_ttl_zero_is_kept():
    _, docs = render_docs("presets/3v1-2b-full.values.yaml", {"jobs": {"ttlSecondsAfterFinished": 0}})
    assert all(d["spec"]["ttlSecondsAfterFinished"] == 0 for d in docs if d["kind"] == "Job")


def test_kueue_queue_suspends_every_job():
    _, docs = _render("presets/6v2-2b-full.values.yaml", "kueue")
    jobs = [d for d in docs if d["kind"] == "Job"]
    assert len(jobs) == 7
    for d in jobs:
        assert d["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue" and d["spec"]["suspend"] is True


def test_jobset_gang_places_all_pods_as_one_group():
    _, docs = _render("presets/6v2-2b-full.values.yaml", "jobset")
    assert not [d for d in docs if d["kind"] == "Job"]
    (js,) = [d for d in docs if d["kind"] == "JobSet"]
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue" and js["spec"]["suspend"] is True
    assert js["spec"]["failurePolicy"] == {"maxRestarts": 2}
    assert js["spec"]["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["learner"]}
    names = [rj["name"] for rj in js["spec"]["replicatedJobs"]]
    assert names == [f"server-{i}" for i in range(6)] + ["learner"]
    assert all(rj["replicas"] == 1 and "suspend" not in rj["template"]["spec"] for rj in js["spec"]["replicatedJobs"])
    # the same pods as the separate Jobs
    _, plain = _render("presets/6v2-2b-full.values.yaml", "defaults")
    assert [p for _, _, p in _gpu_pods(docs)] == [p for _, _, p in sorted(_gpu_pods(plain), key=_server_first)]


def _server_first(item):
    name, component, _ = item
    return (component != "rollout-server", int(name.rsplit("-", 1)[-1]) if component == "rollout-server" else 0)


# --- lifecycle --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("values_file", ("presets/6v2-2b-full.values.yaml", "presets/3v1-2b-full.values.yaml"))
def test_servers_are_supervised_to_stop_when_the_learner_ends(values_file):
    _, docs = _render(values_file, "defaults")
    (learner,) = workload(docs, "learner")
    servers = workload(docs, "rollout-server")
    largs = args_of(learner)
    assert largs[:2] == ["supervise", "learner"] and largs[largs.index("--") + 1:][:2] == ["launch", "learner"]
    assert "--final-on-failure" not in largs  # learner.backoffLimit 2: a failed pod is restarted and resumes
    assert flag(largs, "--expect-watchers") == str(len(servers))
    control = flag(largs, "--control-port")
    for s in servers:
        args = args_of(s)
        assert args[:2] == ["supervise", "server"] and args[args.index("--") + 1:][:2] == ["launch", "server"]
        assert flag(args, "--learner-control") == f"http://127.0.0.1:{control}"
        assert s["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"


def test_a_learner_without_retries_is_final_on_failure():
    _, docs = render_docs("presets/3v1-2b-full.values.yaml", {"learner": {"backoffLimit": 0}})
    (learner,) = workload(docs, "learner")
    assert "--final-on-failure" in args_of(learner) and learner["spec"]["backoffLimit"] == 0
    _, docs = render_docs("presets/3v1-2b-full.values.yaml")
    (learner,) = workload(docs, "learner")
    assert learner["spec"]["backoffLimit"] == 2 and flag(args_of(learner), "--resume") == "auto"


@pytest.mark.parametrize(("values_file", "option"), [("presets/6v2-2b-full.values.yaml", "no-lifecycle"), ("presets/colocate-4-2b-full.values.yaml", "defaults")])
def test_no_supervisor_without_lifecycle_or_servers(values_file, option):
    _, docs = _render(values_file, option)
    for d in workload(docs, "rollout-server") + workload(docs, "learner"):
        assert args_of(d)[0] == "launch"


# --- metrics ----------------------------------------------------------------------------------------------------

def _check_pod_monitor(pm):
    """The monitoring.coreos.com/v1 PodMonitor fields the chart uses, by the CRD's rules."""
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(pm["spec"]) == {"selector", "podMetricsEndpoints"}
    assert pm["spec"]["selector"]["matchLabels"]
    for ep in pm["spec"]["podMetricsEndpoints"]:
        assert set(ep) <= {"portNumber", "path", "interval", "scrapeTimeout", "relabelings"}
        assert isinstance(ep["portNumber"], int) and 1 <= ep["portNumber"] <= 65535 and ep["path"] == "/metrics"
        assert re.fullmatch(r"[0-9]+(ms|s|m|h)", ep["interval"])
        for r in ep["relabelings"]:
            assert r["action"] == "keep" and all(re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", x) for x in r["sourceLabels"])


@pytest.mark.parametrize("values_file", ALL_VALUES)
def test_metrics_off_by_default(values_file):
    _, docs = _render(values_file, "defaults")
    assert not [d for d in docs if d["kind"] == "PodMonitor"]
    for _, _, pod in _gpu_pods(docs):
        c = pod["spec"]["containers"][0]
        assert "--metrics-port" not in c["args"] and "POD_IP" not in [e["name"] for e in c["env"]]
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and "train.yaml" in d.get("data", {}))
    assert "metrics_port" not in (yaml.safe_load(cm["data"]["train.yaml"]).get("training") or {})


@pytest.mark.parametrize("values_file", ALL_VALUES)
def test_metrics_ports_pod_monitor_and_learner_exporter(values_file):
    values, docs = _render(values_file, "metrics")
    (pm,) = [d for d in docs if d["kind"] == "PodMonitor"]
    _check_pod_monitor(pm)
    assert pm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    pods = _gpu_pods(docs)
    servers = [(n, p) for n, c, p in pods if c == "rollout-server"]
    expected = []
    for _, pod in servers:
        c = pod["spec"]["containers"][0]
        args = [str(a) for a in c["args"]]
        port = int(flag(args, "--port"))
        assert int(flag(args, "--metrics-port")) == port + 1000
        assert flag(args, "--metrics-host") == "$(POD_IP)"  # the kubelet expands it from the downward API
        assert args[args.index("--metrics-port") - 1] == "--" and args.count("--") == 1 + ("supervise" in args)
        env = {e["name"]: e for e in c["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        expected.append((port + 1000, pod["metadata"]["labels"]["rollout-matching/server-index"]))
    eps = pm["spec"]["podMetricsEndpoints"]
    assert [(e["portNumber"], e["relabelings"][0]["regex"]) for e in eps[:len(servers)]] == expected
    assert eps[-1]["portNumber"] == 9400 and eps[-1]["relabelings"][0]["regex"] == "learner"
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and "train.yaml" in d.get("data", {}))
    training = yaml.safe_load(cm["data"]["train.yaml"])["training"]
    assert training["metrics_port"] == 9400 and training["metrics_host"] == "${POD_IP}"
    assert {c.what for c in port_claims(docs)} >= {"metrics training.metrics_port"} | (
        {"metrics --metrics-port"} if servers else set())
    assert check_ports(docs) == []


def test_metrics_on_loopback_without_pod_monitor_or_learner_port():
    _, docs = _render("presets/3v1-2b-full.values.yaml", "defaults")
    _, docs = render_docs("presets/3v1-2b-full.values.yaml", {"metrics": {"enabled": True, "host": "127.0.0.1"}})
    assert not [d for d in docs if d["kind"] == "PodMonitor"]
    for _, _, pod in _gpu_pods(docs):
        c = pod["spec"]["containers"][0]
        assert "POD_IP" not in [e["name"] for e in c["env"]]
        if "--metrics-host" in c["args"]:
            assert flag([str(a) for a in c["args"]], "--metrics-host") == "127.0.0.1"
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and "train.yaml" in d.get("data", {}))
    assert "metrics_port" not in (yaml.safe_load(cm["data"]["train.yaml"]).get("training") or {})


@pytest.mark.parametrize("values,expected", [
    ({"metrics": {"podMonitor": {"enabled": True}}}, "metrics.podMonitor.enabled needs metrics.enabled"),
    ({"metrics": {"enabled": True, "serverPortOffset": 12050}}, "lies in the internal port blocks"),
    ({"rolloutServer": {"instances": [{"port": 8000, "gpus": [0]}, {"port": 9000, "gpus": [2]}]},
      "metrics": {"enabled": True}}, "is the HTTP port of"),
])
def test_metrics_port_rules_fail_the_render(values, expected):
    with pytest.raises(Exception) as err:
        render_chart(values)
    assert expected in str(err.value)


def test_metrics_schema_rejects_unknown_keys():
    with pytest.raises(Exception) as err:
        render_chart({"metrics": {"serviceMonitor": {"enabled": True}}})
    assert "metrics" in str(err.value)
