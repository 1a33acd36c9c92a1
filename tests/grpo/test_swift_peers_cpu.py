"""CPU side of ``trainer.conformance`` (the one-GPU ms-swift conformance check): the command lines it builds, the
JSON / log helpers, the timeout-and-kill helper on real subprocesses, and our client subprocess against a scripted
server. ``swift rollout`` itself needs a GPU; on the H200 it served from the same argv and model directory
(H200, 2026-11-25).
The GPU run itself: ``python -m trainer.conformance --out DIR`` (docs/concepts/weight-sync.md, ``swift rollout``)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from trainer.bench.processes import stop_group
from trainer.conformance import peers, protocol, rlhf, rollout, swift_logs

MODEL = Path("/nonexistent/peers-model")


def _after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_swift_rollout_argv_has_server_flags_and_model_dir():
    argv = rollout.rollout_argv(MODEL, 8123)
    assert argv[0] == sys.executable and argv[1].endswith(os.path.join("swift", "cli", "rollout.py"))
    assert _after(argv, "--model") == str(MODEL)
    assert _after(argv, "--host") == "127.0.0.1" and _after(argv, "--port") == "8123"
    assert _after(argv, "--vllm_gpu_memory_utilization") == "0.3"
    assert _after(argv, "--vllm_max_model_len") == "2048"
    assert _after(argv, "--vllm_enforce_eager") == "true"
    assert _after(argv, "--vllm_data_parallel_size") == "1" and _after(argv, "--vllm_tensor_parallel_size") == "1"
    assert _after(argv, "--model_type") == "qwen3" and _after(argv, "--template") == rollout.TEMPLATE


def test_trainer_serve_argv():
    argv = rlhf.serve_argv(MODEL, 8124)
    assert argv[:5] == [sys.executable, "-m", "trainer", "serve", "--engine"] and argv[5] == "vllm"
    assert _after(argv, "--model") == str(MODEL) and _after(argv, "--port") == "8124"
    assert _after(argv, "--max-model-len") == "2048" and _after(argv, "--gpu-memory-utilization") == "0.3"
    assert "--enforce-eager" in argv and _after(argv, "--dtype") == "bfloat16"


def test_swift_rlhf_argv_from_the_summary_config(tmp_path):
    cfg = rlhf.grpo_config(tmp_path, MODEL, 8124, 51300)
    argv, env = rlhf.rlhf_command(cfg)
    assert argv[:4] == [sys.executable, "-m", "swift.cli.main", "rlhf"]
    assert _after(argv, "--model") == str(MODEL)
    assert _after(argv, "--rlhf_type") == "grpo"
    assert _after(argv, "--use_vllm") == "true" and _after(argv, "--vllm_mode") == "server"
    assert _after(argv, "--vllm_server_host") == "127.0.0.1" and _after(argv, "--vllm_server_port") == "8124"
    assert _after(argv, "--vllm_server_group_port") == "51300"
    assert _after(argv, "--max_steps") == "2" and _after(argv, "--model_type") == "qwen3"
    assert "summary.attr_key_recall" in argv  # the rewards of summary_1024_attr_key_recall.yaml, via our plugin
    assert _after(argv, "--external_plugins").endswith("swift_plugin.py")
    assert env["NPROC_PER_NODE"] == "1"
    rows = [json.loads(x) for x in Path(_after(argv, "--dataset")).read_text().splitlines()]
    assert rows and all("images" not in r and "<image>" not in r["messages"][-1]["content"] for r in rows)


def test_swift_cli_dispatch_matches_swift_main():
    pytest.importorskip("swift", reason="ms-swift is not installed (make setup installs it via mk/grpo.mk)")
    from swift.cli.main import ROUTE_MAPPING

    assert ROUTE_MAPPING["rollout"] == "swift.cli.rollout" and ROUTE_MAPPING["rlhf"] == "swift.cli.rlhf"
    assert Path(peers.swift_cli("rollout")[1]).is_file()


def test_write_json_and_log_readers(tmp_path):
    path = tmp_path / "d" / "swift_peers.json"
    peers.write_json(path, {"a": 1, "p": Path("/x")})
    peers.write_json(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2} and not list(path.parent.glob("*.tmp"))
    log = ('INFO:     127.0.0.1:5 - "GET /health/ HTTP/1.1" 200 OK\n'
           'INFO:     127.0.0.1:5 - "POST /update_adapter_param/ HTTP/1.1" 404 Not Found\n'
           'INFO:     127.0.0.1:5 - "POST /update_adapter_param/ HTTP/1.1" 404 Not Found\n')
    reqs = protocol.access_log(log)
    assert reqs[0] == {"method": "GET", "path": "/health/", "status": 200} and len(reqs) == 3
    found = protocol.non_2xx(reqs, "rlhf", "our server")
    assert len(found) == 1 and "POST /update_adapter_param/ with HTTP 404 (2x)" in found[0]["detail"]
    tb = "noise\nTraceback (most recent call last):\n  File x\nRuntimeError: NCCL error: invalid usage\n"
    assert peers.error_excerpt(tb).startswith("Traceback") and "invalid usage" in peers.error_excerpt(tb)
    assert peers.nccl_lines("a\nNCCL WARN Duplicate GPU detected\nb") == ["NCCL WARN Duplicate GPU detected"]
    swift = {"GET /get_world_size/": {"status": 200, "shape": {"world_size": "int"}},
             "POST /infer/": {"status": 200, "shape": [{"response": {"choices": "list"}}]}}
    ours = {"GET /get_world_size/": {"status": 200, "shape": {"world_size": "int"}},
            "POST /infer/": {"status": 422, "shape": {"detail": "str"}}}
    diff = protocol.compare_probes(swift, ours)
    assert [d["detail"] for d in diff] == ["POST /infer/: swift rollout HTTP 200, ours HTTP 422"]
    result = {"rollout": {"server": {"requests": reqs}, "failed": {"generate": "x: /infer/ answered HTTP 500: boom"}},
              "static_routes": {"only_swift": ["POST /update_adapter_param/"]}}
    kinds = sorted(f["kind"] for f in protocol.findings(result))
    assert kinds == ["client", "route", "status"]


def test_static_routes_read_both_sources():
    pytest.importorskip("swift", reason="ms-swift is not installed (make setup installs it via mk/grpo.mk)")
    routes = protocol.static_routes()
    assert "POST /init_communicator/" in routes["swift_rollout"] and "POST /infer/" in routes["swift_rollout"]
    assert "GET /rm/info/" in routes["only_ours"]  # ours only: the in-band / torch-NCCL extensions


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its (dead) parent's reaper counts as gone
        return f.read().split(")")[-1].split()[0] != "Z"


def test_timeout_kills_the_whole_process_group(tmp_path):
    pids = tmp_path / "pids"
    script = ("import os, subprocess, sys, time\n"
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
              f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{c.pid}}')\n"
              "print('started', flush=True)\n"
              "time.sleep(120)\n")
    rec = peers.run_logged([sys.executable, "-c", script], tmp_path / "logs" / "sleeper.log", timeout_s=3)
    assert rec["timed_out"] and rec["rc"] == -signal.SIGTERM and "started" in (tmp_path / "logs/sleeper.log").read_text()
    assert rec["error"].startswith("no exit within 3s") and rec["error"].endswith("started")
    parent, child = (int(x) for x in pids.read_text().split())
    # run_logged returns once the group is empty: the child it never waited for is gone with its parent
    assert not _alive(parent) and not _alive(child)


def test_sigterm_ignored_gets_sigkill(tmp_path):
    script = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(60)\n"
    peer = peers.Peer([sys.executable, "-c", script], tmp_path / "stubborn.log")
    deadline = time.monotonic() + 120  # a hang guard only: the handler is in once "up" is printed
    while "up" not in peer.log.read_text() and peer.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "up" in peer.log.read_text(), "the peer never started"
    stop_group(peer.proc, grace_s=1.0)
    assert peer.proc.returncode == -signal.SIGKILL, "SIGTERM is ignored: SIGKILL ended it"
    assert not _alive(peer.proc.pid)


def test_failed_command_records_rc_and_error(tmp_path):
    rec = peers.run_logged([sys.executable, "-c", "import sys; print('hello'); raise SystemExit('it broke')"],
                        tmp_path / "fail.log", timeout_s=30)
    assert rec["rc"] == 1 and not rec["timed_out"] and "it broke" in rec["error"]
    assert rec["log"] == "logs/fail.log" and "-c" in rec["command"]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    import torch

    from trainer.bench.models import CPU_SHAPE, save_random_model_dir

    return save_random_model_dir(tmp_path_factory.mktemp("peers") / "model", CPU_SHAPE, dtype=torch.float32)


@pytest.mark.slow
def test_client_subprocess_against_a_scripted_server(tmp_path, tiny_model_dir):
    """The rollout direction's client, end to end against our scripted server: every stage lands in the result
    file; the NCCL sync fails on CPU (pynccl needs CUDA, or vLLM is absent) and that is recorded, not raised."""
    from trainer.launch.health import serve_subprocess

    with serve_subprocess("--engine", "scripted", "--model", str(tiny_model_dir), timeout_s=120) as (url, _, _):
        res = tmp_path / "client.json"
        rec = peers.run_logged(rollout.client_argv(url, tiny_model_dir, res, "all"), tmp_path / "client.log", timeout_s=240)
    assert rec["rc"] == 0, (tmp_path / "client.log").read_text()[-3000:]
    stages = json.loads(res.read_text())
    assert stages["connect_health"]["ok"] and stages["engine_type"]["ok"], stages
    gen = stages["generate"]
    assert gen["ok"] and gen["n"] == rollout.BATCH and all(1 <= n <= rollout.NEW_TOKENS for n in gen["response_lengths"]), gen
    assert not stages["sync_nccl"]["ok"] and stages["sync_nccl"]["error"], stages["sync_nccl"]
    assert stages["generate_fresh_client"]["ok"], stages


def test_a_peer_that_exits_before_health_is_recorded_as_a_failed_start(tmp_path):
    saves = []
    peer = peers.Peer([sys.executable, "-c", "raise SystemExit('no GPU here')"], tmp_path / "logs" / "dead.log")
    r = {"server": {}, "worked": [], "failed": {}}
    try:
        ok = protocol.started_and_probed("http://127.0.0.1:9", peer, 60.0, r, lambda: saves.append(1))
    finally:
        peer.stop()
    assert not ok and r["worked"] == [] and "probes" not in r
    assert "exited with code 1" in r["failed"]["server_start"] and "no GPU here" in r["failed"]["server_start"]
    assert saves == [1], "the failed start is saved before returning"


def test_a_peer_that_serves_is_probed(tmp_path, tiny_model_dir):
    from trainer.launch.ports import listen_port as free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "trainer", "serve", "--engine", "scripted", "--model", str(tiny_model_dir),
            "--host", "127.0.0.1", "--port", str(port)]
    peer = peers.Peer(argv, tmp_path / "logs" / "serve.log")
    r = {"server": {}, "worked": [], "failed": {}}
    try:
        ok = protocol.started_and_probed(url, peer, 300.0, r, lambda: None)
    finally:
        peer.stop()
    assert ok, r
    assert r["worked"] == ["server_start"] and r["server"]["health"]["ok"] and r["probes"]


# -- the 4b shape: placement, config, timings -----------------------------------------------------


def test_two_gpus_put_the_server_and_the_learner_on_their_own_device():
    two, one = peers.placement(2), peers.placement(1)
    assert two["server_env"] == {"CUDA_VISIBLE_DEVICES": "0"} and two["learner_gpus"] == [1]
    assert two["server_util"] > one["server_util"] == 0.3
    assert one["server_env"] == {} and one["learner_gpus"] is None and peers.placement(0) == one
    assert peers.learner_env(two)["CUDA_VISIBLE_DEVICES"] == "1"
    assert peers.learner_env(one).get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")
    assert _after(rollout.rollout_argv(MODEL, 8123, two["server_util"]), "--vllm_gpu_memory_utilization") == "0.85"


def test_4b_shape_builds_a_vl_summary_run_with_images_on_gpu_1(tmp_path):
    shape = rlhf.RLHF_SHAPES["4b"]
    cfg = rlhf.grpo_config(tmp_path, MODEL, 8124, 51300, shape=shape, server_util=0.85)
    argv, env = rlhf.rlhf_command(cfg, [1])
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["NPROC_PER_NODE"] == "1"
    assert _after(argv, "--model_type") == "qwen3_vl" and _after(argv, "--template") == "qwen3_vl"
    assert _after(argv, "--max_completion_length") == "2048" and _after(argv, "--max_steps") == "3"
    assert _after(argv, "--gradient_checkpointing") == "true"
    assert _after(argv, "--tuner_type") == "lora" and _after(argv, "--use_dora") == "true"
    assert _after(argv, "--freeze_vit") == "false"
    assert _after(argv, "--num_generations") == "4" and _after(argv, "--generation_batch_size") == "4"
    rows = [json.loads(x) for x in Path(_after(argv, "--dataset")).read_text().splitlines()]
    from PIL import Image

    assert rows and all(len(r["images"]) == 1 and "<image>" in r["messages"][-1]["content"] for r in rows)
    assert Image.open(rows[0]["images"][0]).size == (1024, 1024)
    with_plugin = rlhf.with_template_ids_plugin(argv)
    plugins = with_plugin[with_plugin.index("--external_plugins") + 1:]
    plugins = plugins[:next((i for i, a in enumerate(plugins) if a.startswith("--")), len(plugins))]
    assert plugins[0].endswith("swift_plugin.py") and plugins[1].endswith("swift_template_ids.py")
    assert len(with_plugin) == len(argv) + 1
    serve = rlhf.serve_argv(MODEL, 8124, shape, 0.85)
    assert "--enforce-eager" not in serve and _after(serve, "--max-model-len") == "8192"
    assert _after(serve, "--gpu-memory-utilization") == "0.85"


def test_step_seconds_undo_swift_running_mean():
    records = [{"global_step/max_steps": "1/3", "train_speed(s/it)": 30.0},
               {"global_step/max_steps": "2/3", "train_speed(s/it)": 20.0},  # 40 s in all: step 2 took 10 s
               {"global_step/max_steps": "3/3", "train_speed(s/it)": 16.0, "memory(GiB)": 41.5},
               {"global_step/max_steps": "3/3", "train_speed(s/it)": 16.0, "train_runtime": 48.0}]
    assert swift_logs.step_seconds(records) == [30.0, 10.0, 8.0]
    server = {"infer_calls": 3.0, "infer_s": 15.0, "syncs": 3.0, "sync_s": 1.5, "generated_tokens": 24576.0,
              "prompt_tokens": 4000.0}
    t = swift_logs.grpo_step_summary([30.0, 10.0, 8.0], server, records)
    assert t["step_s_mean"] == 9.0 and t["steps_in_mean"] == "2..3"
    assert t["generate_s_per_step"] == 5.0 and t["weight_sync_s_per_sync_server_side"] == 0.5
    assert t["rest_of_step_s"] == 3.5 and t["learner_peak_reserved_gib"] == 41.5
    assert swift_logs.grpo_step_summary([], {**server, "infer_calls": 0.0}, [])["step_s_mean"] is None


def test_server_timings_read_our_servers_metrics(tmp_path, tiny_model_dir):
    """The rlhf direction's generate/sync figures come from the server's own /metrics; here a scripted server
    after two /infer/ calls and one in-band sync."""
    import httpx
    from safetensors.torch import load_file, save

    from trainer.launch.ports import listen_port

    port = listen_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "trainer", "serve", "--engine", "scripted", "--model", str(tiny_model_dir),
            "--host", "127.0.0.1", "--port", str(port)]
    peer = peers.Peer(argv, tmp_path / "logs" / "serve.log")
    try:
        assert peers.wait_health(url, peer, 300.0)["ok"]
        body = {"infer_requests": [{"messages": [{"role": "user", "content": "hi"}], "images": []}] * 2,
                "request_config": {"max_tokens": 4, "temperature": 0.0}}
        with httpx.Client(timeout=60.0, trust_env=False) as c:
            for _ in range(2):
                assert c.post(url + "/infer/", json=body).status_code == 200
            norm = load_file(str(tiny_model_dir / "model.safetensors"))["model.norm.weight"]
            r = c.post(url + "/rm/update_weights_inband/?kind=full", content=save({"model.norm.weight": norm + 1}))
            assert r.status_code == 200, r.text
        t = rlhf.server_timings(url)
    finally:
        peer.stop()
    assert t["infer_calls"] == 2 and t["infer_s"] > 0 and t["generated_tokens"] > 0 and t["prompt_tokens"] > 0
    assert t["syncs"] == 1 and t["sync_s"] > 0


def test_template_ids_plugin_points_swift_qwen_vl_templates_at_the_tokenizer(tmp_path):
    """In a fresh interpreter (it patches ms-swift's template classes on import)."""
    pytest.importorskip("swift", reason="ms-swift is not installed (make setup installs it via mk/grpo.mk)")
    import subprocess

    from trainer.modeling.fixtures import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.save_pretrained(tmp_path)
    code = ("import runpy; runpy.run_path('trainer/conformance/swift_template_ids.py'); "
            "from swift.template.templates.qwen import Qwen2VLTemplate, Qwen3VLTemplate; "
            "print(Qwen3VLTemplate.image_token_id, Qwen3VLTemplate.video_token_id, Qwen2VLTemplate.image_token_id)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=peers.REPO, env={**os.environ, "RM_SWIFT_TOKENIZER_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    image, video = tok.convert_tokens_to_ids("<|image_pad|>"), tok.convert_tokens_to_ids("<|video_pad|>")
    assert out.stdout.split()[-3:] == [str(image), str(video), str(image)]
    assert image != 151655


# -- a learning signal at random weights -----------------------------------------------------------------------

NO_SIGNAL_RUN = Path(__file__).parent / "fixtures/swift_4b_no_signal"
# ms-swift's console lines, as in NO_SIGNAL_RUN/swift_rlhf.log (progress bar, then the step's dict; trimmed keys)
SWIFT_LOG = (
    "\rTrain:   0%|          | 0/3 [00:00<?, ?it/s]\rTrain:  33%|###3      | 1/3 [00:18<00:36, 18.40s/it]"
    "                                                    {'loss': '0', 'grad_norm': '0', 'learning_rate': '1e-05', "
    "'completions/mean_length': '2048', 'reward': '-5.5', 'reward_std': '0', 'frac_reward_zero_std': '1', 'kl': '0', "
    "'rewards/SummaryFormatReward/mean': '0', 'rewards/SummaryFormatReward/std': '0', 'step_time': '18.31', "
    "'epoch': '0.0625', 'global_step/max_steps': '1/3', 'elapsed_time': '18s', 'remaining_time': '37s', "
    "'memory(GiB)': '47.7', 'train_speed(s/it)': '18.41'}\n"
    "\rTrain:  67%|######6   | 2/3 [00:33<00:16, 16.34s/it]                                                    "
    "{'loss': '0.0123', 'grad_norm': '0.8731', 'learning_rate': '5e-06', 'reward': '-4.912', 'reward_std': '0.1375', "
    "'frac_reward_zero_std': '0', 'kl': '0.0004', 'rewards/SummaryFormatReward/mean': '0', "
    "'rewards/SummaryFormatReward/std': '0', 'rewards/LengthDistinctReward/mean': '0.588', "
    "'rewards/LengthDistinctReward/std': '0.1375', 'global_step/max_steps': '2/3', 'elapsed_time': '33s', "
    "'memory(GiB)': '47.71', 'train_speed(s/it)': '16.65'}\n"
    "{'train_runtime': '48.33', 'train_samples_per_second': '0.248', 'train_loss': '0.006', 'epoch': '0.1875', "
    "'global_step/max_steps': '3/3', 'elapsed_time': '48s'}\n")


def _random_completions(n: int, tokens: int = 512, seed: int = 0) -> list[str]:
    """What a random-weight model over Qwen's 151,936 ids writes through the embedded tokenizer."""
    import random

    from trainer.modeling.fixtures import tiny_tokenizer

    tok, rng = tiny_tokenizer(), random.Random(seed)
    return [tok.decode([rng.randrange(151936) for _ in range(tokens)]) for _ in range(n)]


def test_signal_reward_varies_between_completions_of_one_prompt_and_is_deterministic(summary_dataset):
    from trainer.grpo import signal_reward as sr

    ref = json.loads(summary_dataset.read_text().splitlines()[0])["summary_ref"]
    completions = _random_completions(4)
    scores = [sr.length_distinct_score(c, ref) for c in completions]
    assert len(set(scores)) == 4, scores  # 4 samples of one prompt: 4 different rewards, std > 0
    assert scores == [sr.length_distinct_score(c, ref) for c in completions]  # deterministic
    assert all(0.0 <= s <= 1.0 for s in scores)
    assert sr.length_distinct_score(ref, ref) > 0.5 + 0.5 * 0.5  # the reference itself: length 1, mostly distinct
    assert sr.length_distinct_score("a" * len(ref), ref) < sr.length_distinct_score(ref, ref)  # a repetition loop
    assert sr.length_closeness(0, 0) == 1.0 and sr.length_closeness(0, 5) == 0.0 and sr.length_closeness(5, 10) == 0.5
    assert sr.distinct_ratio("ab") == 0.0 and sr.distinct_ratio("abcabc") == 0.75


def test_signal_reward_is_an_ms_swift_orm():
    pytest.importorskip("swift", reason="ms-swift is not installed (make setup installs it via mk/grpo.mk)")
    from swift.rewards import orms

    from trainer.grpo import signal_reward as sr

    orm = orms[sr.NAME]()
    got = orm(["x", "a summary line"], summary_ref=["a summary line"] * 2, metadata=[None, None])
    assert got == [sr.length_distinct_score("x", "a summary line"), sr.length_distinct_score("a summary line",
                                                                                             "a summary line")]
    with pytest.raises(KeyError, match="summary_ref"):
        orm(["x"])


@pytest.mark.parametrize("size", ["text", "4b"])
def test_rlhf_argv_samples_at_temperature_1_and_scores_the_signal_reward(tmp_path, size):
    shape = rlhf.RLHF_SHAPES[size]
    argv, _ = rlhf.rlhf_command(rlhf.grpo_config(tmp_path, MODEL, 8124, 51300, shape=shape))
    argv = rlhf.with_signal_reward(argv)
    if shape.images:
        argv = rlhf.with_template_ids_plugin(argv)
    assert _after(argv, "--temperature") == "1.0" and rlhf.GRPO_TEMPERATURE > 0

    def values(flag):
        rest = argv[argv.index(flag) + 1:]
        return rest[:next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))]

    funcs, weights, plugins = values("--reward_funcs"), values("--reward_weights"), values("--external_plugins")
    assert funcs[-1] == rlhf.SIGNAL_REWARD and "summary.attr_key_recall" in funcs  # added, the summary ones kept
    assert len(weights) == len(funcs) and weights[-1] == "1"
    assert plugins[0].endswith("swift_plugin.py") and plugins[1] == str(rlhf.SIGNAL_PLUGIN) and rlhf.SIGNAL_PLUGIN.is_file()
    assert plugins[2:] == ([str(Path(rlhf.__file__).with_name("swift_template_ids.py"))] if shape.images else [])
    assert rlhf.extend_list_flag(["a", "--x", "1"], "--y", ["2"]) == ["a", "--x", "1", "--y", "2"]


def test_swift_log_lines_give_per_step_metrics_and_a_learning_signal():
    steps = swift_logs.step_metrics(swift_logs.log_records(SWIFT_LOG))
    assert [s["step"] for s in steps] == [1, 2]  # the train_runtime summary is not a step
    assert steps[0]["reward"] == -5.5 and steps[0]["reward_std"] == 0.0 and steps[0]["grad_norm"] == 0.0
    assert steps[1] == {"step": 2, "reward": -4.912, "reward_std": 0.1375, "frac_reward_zero_std": 0.0,
                        "loss": 0.0123, "grad_norm": 0.8731, "kl": 0.0004, "signal_reward_mean": 0.588,
                        "signal_reward_std": 0.1375, "varying_rewards": ["LengthDistinctReward"]}
    sig = swift_logs.learning_signal(steps)
    assert sig == {"steps": 2, "checked_steps": "2..2", "reward_std_min": 0.0, "reward_std_max": 0.1375,
                   "nonzero_grad_norm_steps": 1, "ok": True}
    assert swift_logs.learning_signal_line(sig, steps).startswith("rlhf learning signal ok")
    flat = swift_logs.learning_signal(steps[:1])  # one step: it is the one checked
    assert not flat["ok"] and "reward_std 0.0" in flat["reason"] and "grad_norm 0.0" in flat["reason"]
    assert not swift_logs.learning_signal([])["ok"] and swift_logs.learning_signal([])["reason"] == "no GRPO step was logged"
    # batch-scaled reward_std > 0 across prompts while every prompt's group is flat: no advantage, not ok
    flat_groups = [{**steps[1], "frac_reward_zero_std": 1.0}] * 2
    assert "frac_reward_zero_std 1" in swift_logs.learning_signal(flat_groups)["reason"]


@pytest.mark.skipif(not (NO_SIGNAL_RUN / "swift_rlhf.log").is_file(), reason="the 4B no-signal run's logs are not present")
def test_the_4b_no_signal_run_is_flagged_as_learning_nothing():
    text = (NO_SIGNAL_RUN / "swift_rlhf.log").read_text(errors="replace")
    steps = swift_logs.step_metrics(swift_logs.log_records(text))
    jsonl = [json.loads(x) for x in (NO_SIGNAL_RUN / "grpo_logging.jsonl").read_text().splitlines() if x.strip()]
    assert steps == swift_logs.step_metrics(jsonl)  # the console log and logging.jsonl agree
    assert [s["step"] for s in steps] == [1, 2, 3] and all(s["reward"] == -5.5 for s in steps)
    sig = swift_logs.learning_signal(steps)
    assert sig["ok"] is False and sig["reward_std_max"] == 0.0 and sig["nonzero_grad_norm_steps"] == 0
    assert "NO LEARNING SIGNAL" in swift_logs.learning_signal_line(sig, steps)
    assert "NO LEARNING SIGNAL" in swift_logs.learning_signal_line(None, [])  # the learner never ran
