"""The images, built on the local base and run with Docker: `--help`, non-root + init, the stub rollout server
(`trainer serve --engine scripted`) speaking the protocol in its container, real stage-2 training steps in server
mode against 1 and 3 server containers (rollouts + weight sync), and the pods the chart renders for 3v1 started
with exactly their rendered args, env, user and mounts on the host network.

Every test here needs a Docker daemon; without one they skip and say why (`bash .ci/docker.sh` starts one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from deploy_helpers import REPO, load_values, manifests_of, render_chart, workload
from docker_pods import logs, pod_container, wait_healthy, write_configmaps
from testcontainers.core.container import DockerContainer

from trainer.deploy.checks import check_manifests
from trainer.launch.ports import listen_port as free_port  # below the ephemeral range

pytestmark = pytest.mark.docker

#: `make images` (the local base) tags the CPU images <the chart's tag>-cpu; the chart's own tag names the GPU images
CPU_SUFFIX = "-cpu"


def _chart_image(key: str) -> str:
    """The CPU image `make images` builds for the chart's ``images.<key>``."""
    from deploy_helpers import CHART, helm

    with helm.Chart.load(str(CHART)) as chart:
        image = chart.values["images"][key]
    return f"{image['repository']}:{image['tag']}{CPU_SUFFIX}"


@pytest.fixture(scope="session")
def docker_client():
    try:
        import docker

        client = docker.from_env()
        client.ping()
    except Exception as exc:  # noqa: BLE001 - any failure means: no usable daemon
        pytest.skip(f"no Docker daemon reachable ({type(exc).__name__}: {exc}); `bash .ci/docker.sh` installs and starts one")
    return client


@pytest.fixture(scope="session")
def images(docker_client):
    """The chart's image tags, (re)built on the local base by the target CI uses (the layer cache makes it quick)."""
    start = time.monotonic()
    proc = subprocess.run(["make", "--no-print-directory", "images"], cwd=REPO, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, f"make images failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    print(f"make images: {time.monotonic() - start:.0f}s")
    return {"learner": _chart_image("learner"), "rollout-server": _chart_image("rolloutServer")}


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """A saved tiny VL model (the servers' tokenizer) and a synthetic dataset, readable by the containers' uid."""
    from trainer.data.synthetic import generate
    from trainer.modeling.fixtures import save_tiny_model

    root = tmp_path_factory.mktemp("deploy-assets")
    models = root / "models"
    save_tiny_model(models / "policy", "vl", seed=0)
    generate(root / "data", 12, seed=0, min_objects=1, max_objects=2)
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return {"models": models, "model": models / "policy", "data": root / "data"}


def _run(client, image: str, *args: str, entrypoint: str | None = None) -> str:
    """Output of ``docker run --rm image args`` (raises with the container's output on a non-zero exit)."""
    return client.containers.run(image, list(args), entrypoint=entrypoint, remove=True).decode()


def test_images_build_non_root_with_an_init_and_a_server_healthcheck(images, docker_client):
    for role, tag in images.items():
        config = docker_client.images.get(tag).attrs["Config"]
        assert config["User"] == "1000:1000", role
        assert config["Entrypoint"][:2] == ["/opt/venv/bin/dumb-init", "--"], role
        assert config["Entrypoint"][2:] == ["python", "-m", "trainer"], role
        assert _run(docker_client, tag, "-u", entrypoint="id").strip() == "1000", role
    server = docker_client.images.get(images["rollout-server"]).attrs["Config"]
    assert server["Healthcheck"]["Test"] == ["CMD", "python", "-m", "trainer.deploy.healthcheck"]


@pytest.mark.parametrize("role", ["learner", "rollout-server"])
def test_docker_run_help_works(images, docker_client, role):
    out = _run(docker_client, images[role], "--help")
    for command in ("launch", "serve", "train", "render-job", "validate"):
        assert command in out, f"{command} missing from --help of {images[role]}"


def test_stub_server_container_speaks_the_rollout_protocol(images):
    port, metrics_port = free_port(), free_port()
    server = (DockerContainer(images["rollout-server"])
              .with_command(["serve", "--engine", "scripted", "--host", "127.0.0.1", "--port", str(port),
                             "--metrics-port", str(metrics_port)])
              .with_kwargs(network_mode="host", read_only=True)
              .with_tmpfs_mount("/tmp").with_tmpfs_mount("/home/app/.cache"))
    url = f"http://127.0.0.1:{port}"
    with server:
        wait_healthy(url, server)
        assert httpx.get(f"{url}/health/").json() == {"status": "ok"}
        assert httpx.get(f"{url}/get_world_size/").json() == {"world_size": 1}
        body = {"infer_requests": [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(3)],
                "request_config": {"max_tokens": 8, "temperature": 0.0, "return_details": True}}
        answers = httpx.post(f"{url}/infer/", json=body, timeout=30).json()
        assert len(answers) == 3
        for answer in answers:
            response = answer.get("response", answer)
            choice = response["choices"][0]
            assert response["prompt_token_ids"] and 1 <= len(choice["token_ids"]) <= 8
            assert choice["finish_reason"] in ("stop", "length")
        assert answers[0] != answers[1], "different prompts, same answer"
        # Prometheus metrics: on the API port (/metrics) and on --metrics-port, the same registry
        for scraped in (httpx.get(f"{url}/metrics", timeout=10), httpx.get(f"http://127.0.0.1:{metrics_port}/metrics",
                                                                         timeout=10)):
            assert scraped.status_code == 200 and scraped.headers["content-type"].startswith("text/plain")
            assert "rm_server_rollout_requests_total 3.0" in scraped.text, scraped.text[:3000]
            assert 'rm_server_http_requests_total{endpoint="/infer/",status="200"} 1.0' in scraped.text
            assert "rm_server_infer_latency_seconds_count 1.0" in scraped.text
        health = server.exec(["python", "-m", "trainer.deploy.healthcheck"])
        assert health.exit_code == 0, health.output
        wrapped = server.get_wrapped_container()
        wrapped.stop(timeout=120)  # SIGTERM, then SIGKILL after 120 s (a clean stop takes about a second)
        wrapped.reload()
        code = wrapped.attrs["State"]["ExitCode"]
        assert code != 137, "SIGKILLed at the stop timeout: SIGTERM was not forwarded to the server (init process)"
        assert code == 0, logs(server)


def _remove(container: DockerContainer) -> None:
    """Remove a container that was created (started or not)."""
    wrapped = container._container
    if wrapped is not None:
        wrapped.remove(force=True)


@dataclass
class TrainingRun:
    urls: list[str]
    returncode: int
    output: str
    metrics: list[dict]
    server_logs: list[str]
    infos: list[dict]


def _stage2_config(data_dir: Path, out_dir: Path, urls: list[str]) -> dict:
    return {
        "model": {"tiny": "vl", "tiny_seed": 0},
        "data": {"train_jsonl": str(data_dir / "train.jsonl")},
        "training": {"output_dir": str(out_dir), "max_steps": 2, "per_device_train_batch_size": 3,
                     "learning_rate": 1e-3, "logging_steps": 1, "report_to": ["jsonl"]},
        "custom": {"trainer_variant": "rollout_matching_sft", "extra": {"rollout_matching": {
            "rollout_backend": "vllm", "rollout_generate_batch_size": 3, "decoding": {"max_new_tokens": 32},
            "vllm": {"mode": "server", "server": {"servers": [{"base_url": u} for u in urls], "timeout_s": 60},
                     "sync": {"mode": "full", "transport": "inband"}}}}},
    }


@pytest.fixture(scope="module", params=[1, 3], ids=["1-server", "3-servers"])
def training_run(request, images, assets, tmp_path_factory) -> TrainingRun:
    """Stage-2 training (2 optimizer steps, in-process learner) against N scripted-server containers."""
    ports = [free_port() for _ in range(request.param)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    data = str(assets["data"])
    servers = [
        DockerContainer(images["rollout-server"])
        .with_command(["launch", "server", "--engine", "scripted", "--host", "127.0.0.1", "--port", str(p),
                       "--gpus", "0", "--model", "/models/policy"])
        .with_volume_mapping(str(assets["model"]), "/models/policy", "ro")
        .with_volume_mapping(data, data, "ro")  # rollout requests carry image paths: same path in the container
        .with_kwargs(network_mode="host", read_only=True, user="1000:1000")
        .with_tmpfs_mount("/tmp").with_tmpfs_mount("/home/app/.cache")
        for p in ports
    ]
    out = tmp_path_factory.mktemp(f"train-{request.param}")
    try:
        for server in servers:
            server.start()
        for server, url in zip(servers, urls):
            wait_healthy(url, server)
        config = out / "train.yaml"
        config.write_text(json.dumps(_stage2_config(assets["data"], out / "run", urls)))
        proc = subprocess.run([sys.executable, "-m", "trainer", "train", "--config", str(config)], cwd=out,
                              capture_output=True, text=True, timeout=900,
                              env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""})
        metrics_file = out / "run" / "metrics.jsonl"
        metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
        infos = [httpx.get(f"{u}/rm/info/", timeout=10).json() for u in urls]
        yield TrainingRun(urls, proc.returncode, proc.stdout[-6000:] + proc.stderr[-6000:], metrics,
                          [logs(s) for s in servers], infos)
    finally:
        for server in servers:
            _remove(server)


def test_learner_trains_against_server_containers(training_run):
    assert training_run.returncode == 0, training_run.output
    steps = [m for m in training_run.metrics if "loss" in m and m.get("phase", "stage2") == "stage2"]
    assert len(steps) >= 2, training_run.metrics
    for url, server_log in zip(training_run.urls, training_run.server_logs):
        assert '"POST /infer/ HTTP/1.1" 200' in server_log, f"{url} served no rollouts:\n{server_log[-2000:]}"


def test_weight_sync_reaches_every_server_container(training_run):
    assert training_run.returncode == 0, training_run.output
    for url, info in zip(training_run.urls, training_run.infos):
        full = [u for u in info["updates"] if u.get("kind") == "full"]
        assert full, (f"{url} received no full weight update during training (the learner must sync before fresh "
                      f"rollouts); its update log: {info['updates']}")


def _free_or_remapped(ports: list[int]) -> list[int]:
    def free(port: int) -> bool:
        import socket

        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return True
            except OSError:
                return False

    return ports if all(free(p) for p in ports) else [free_port() for _ in ports]


def test_chart_rendered_3v1_pods_talk_to_each_other(images, assets, tmp_path):
    values = load_values("presets/3v1-2b-full.values.yaml")
    ports = _free_or_remapped([i["port"] for i in values["rolloutServer"]["instances"]])
    values["rolloutServer"].update(
        engine="scripted", model="/models/policy",
        instances=[{**inst, "port": p} for inst, p in zip(values["rolloutServer"]["instances"], ports)])
    values["storage"] = {"models": {"hostPath": str(assets["models"]), "mountPath": "/models"},
                         "data": {"hostPath": str(assets["data"]), "mountPath": "/data"},
                         "output": {"hostPath": "", "ephemeral": True, "mountPath": "/output", "sizeLimit": "1Gi"}}
    values["learner"]["healthTimeoutS"] = 180
    shipped_server = values["learner"]["config"]["custom"]["extra"]["rollout_matching"]["vllm"]["server"]
    assert shipped_server["async_rollouts"]["enabled"], "presets/3v1-2b-full.values.yaml ships async rollouts"
    values["learner"]["config"] = {
        "model": {"path": None, "tiny": "vl", "torch_dtype": "float32"},
        "data": {"train_jsonl": "/data/train.jsonl", "image_root": "/data"},
        "training": {"output_dir": "/output/run", "max_steps": 2, "per_device_train_batch_size": 3, "bf16": False,
                     "report_to": ["jsonl"]},
        "custom": {"extra": {"rollout_matching": {"rollout_generate_batch_size": 3, "decoding": {"max_new_tokens": 32},
                                                  "vllm": {"sync": {"transport": "inband"},
                                                           "server": shipped_server}}}},
    }
    values["images"] = {key: {"tag": _chart_image(key).rsplit(":", 1)[1]} for key in ("rolloutServer", "learner")}
    manifests = manifests_of(render_chart(values))
    assert check_manifests(manifests, values["node"]["gpuCount"]) == []
    configmaps = write_configmaps(manifests, tmp_path / "configmaps")
    servers = workload(manifests, "rollout-server")
    (learner,) = workload(manifests, "learner")
    (hook,) = [d for d in manifests if d["kind"] == "Pod"]
    assert len(servers) == 3
    started = []
    try:
        for doc in servers:
            ctr = pod_container(doc["spec"]["template"]["spec"], configmaps, f"{doc['metadata']['name']}-{os.getpid()}",
                                tmp_path / "emptydirs")
            started.append(ctr)
            ctr.start()
        urls = []
        for doc, ctr in zip(servers, started):
            probe = doc["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["httpGet"]
            url = f"http://{probe['host']}:{probe['port']}"
            wait_healthy(url, ctr, path=probe["path"])
            urls.append(url)
        # helm test while the servers run (they stop once the learner is done)
        hook_ctr = pod_container(hook["spec"], configmaps, f"helm-test-{os.getpid()}", tmp_path / "emptydirs")
        started.append(hook_ctr)
        hook_ctr.start()
        hook_status = hook_ctr.get_wrapped_container().wait(timeout=120)
        assert hook_status["StatusCode"] == 0, logs(hook_ctr)
        assert "deployment check passed" in logs(hook_ctr)
        learner_ctr = pod_container(learner["spec"]["template"]["spec"], configmaps, f"learner-{os.getpid()}",
                                    tmp_path / "emptydirs")
        started.append(learner_ctr)
        learner_ctr.start()
        status = learner_ctr.get_wrapped_container().wait(timeout=900)
        learner_log = logs(learner_ctr)
        assert status["StatusCode"] == 0, learner_log[-8000:]
        assert f"waiting up to 180s for 3 server(s): {', '.join(urls)}" in learner_log
        assert "3/3 server(s) read the final state" in learner_log
        assert "'rollout/prefetch_used'" in learner_log, "the shipped async rollouts decoded a step ahead"
        # lifecycle: every server stops on its own once the learner succeeded (exit 0: its Job would complete)
        for url, ctr in zip(urls, started[:3]):
            server_status = ctr.get_wrapped_container().wait(timeout=120)
            server_log = logs(ctr)
            assert server_status["StatusCode"] == 0, server_log[-4000:]
            assert "learner succeeded (exit 0): stopping the server" in server_log
            assert '"POST /infer/ HTTP/1.1" 200' in server_log, f"{url} served no rollouts"
            assert "POST /rm/update_weights_inband/?kind=full HTTP/1.1\" 200" in server_log, \
                f"{url} received no full weight update"
    finally:
        for ctr in started:
            _remove(ctr)


@pytest.mark.slow
def test_training_survives_a_server_container_killed_mid_run(images, assets, tmp_path):
    """Three scripted-server containers; one is SIGKILLed once step 1 has started. Its chunks are re-rolled on the
    other two, it is quarantined (no weight pushes to a dead server), training finishes, and the ledger shows each
    of the 12 samples trained exactly once (4 steps x 3 = one epoch)."""
    import threading
    from collections import Counter

    ports = [free_port() for _ in range(3)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    data = str(assets["data"])
    servers = [
        DockerContainer(images["rollout-server"])
        .with_command(["serve", "--engine", "scripted", "--host", "127.0.0.1", "--port", str(p),
                       "--model", "/models/policy"])
        .with_volume_mapping(str(assets["model"]), "/models/policy", "ro")
        .with_volume_mapping(data, data, "ro")
        .with_kwargs(network_mode="host", read_only=True, user="1000:1000")
        .with_tmpfs_mount("/tmp").with_tmpfs_mount("/home/app/.cache")
        for p in ports
    ]
    run_dir = tmp_path / "run"
    ledger_path = run_dir / "stage2" / "ledger.jsonl"
    killed: dict[str, object] = {}
    done = threading.Event()

    def kill_in_step_1() -> None:
        while not done.is_set():
            rows = ledger_path.read_text().splitlines() if ledger_path.exists() else []
            if any(json.loads(r)["step"] >= 1 for r in rows if r.strip()):
                servers[1].get_wrapped_container().kill()
                killed["after_rows"] = len(rows)
                return
            time.sleep(0.05)

    try:
        for server in servers:
            server.start()
        for server, url in zip(servers, urls):
            wait_healthy(url, server)
        cfg = _stage2_config(assets["data"], run_dir, urls)
        cfg["training"]["max_steps"] = 4
        cfg["custom"]["extra"]["rollout_matching"]["vllm"]["server"].update(infer_timeout_s=30, max_retries=1)
        config = tmp_path / "train.yaml"
        config.write_text(json.dumps(cfg))
        killer = threading.Thread(target=kill_in_step_1, daemon=True)
        killer.start()
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "trainer", "train", "--config", str(config)], cwd=tmp_path,
                              capture_output=True, text=True, timeout=900,
                              env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""})
        done.set()
        killer.join(5)
        print(f"training with a killed server container: {time.monotonic() - t0:.0f}s")
        output = proc.stdout[-6000:] + proc.stderr[-6000:]
        assert "after_rows" in killed, f"training ended before step 1 started; the kill never landed:\n{output}"
        assert proc.returncode == 0, output
        rows = [json.loads(r) for r in ledger_path.read_text().splitlines() if r.strip()]
        assert len(rows) > killed["after_rows"], "no sample was trained after the kill"
        want = [json.loads(r)["id"] for r in (assets["data"] / "train.jsonl").read_text().splitlines()]
        counts = Counter(r["sample_id"] for r in rows)
        assert sorted(counts) == sorted(want) and set(counts.values()) == {1}, f"each sample exactly once: {counts}"
        assert f"quarantining rollout server {urls[1]}" in proc.stderr, output
        survivors = [logs(s) for i, s in enumerate(servers) if i != 1]
        for url, server_log in zip([urls[0], urls[2]], survivors):
            assert server_log.count('"POST /infer/ HTTP/1.1" 200') >= 3, f"{url} did not keep serving:\n{server_log[-2000:]}"
    finally:
        done.set()
        for server in servers:
            _remove(server)
