"""``vllm.server.async_rollouts``: real stage-2 training of the tiny model against in-process scripted
rollout servers that take a set time per ``/infer/`` call. The next micro-batch is decoded while this one trains:
decodes start while the learner trains (how much idle time that saves is measured by ``python -m trainer bench run
benchmarks/layouts.yaml --only 1v1-sync,1v1-async``, not asserted here), the ledger (order, steps) is the one of a
run without overlap, every sample is trained exactly once, staleness is bounded, a SIGKILL mid-overlap resumes
exactly, and a stalled server during an overlapped decode is retried and quarantined as without overlap."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from tests.server.stall import INFER_TIMEOUT_S, Stall
from trainer.bench.async_rollouts import TimedEngine, run_with_timeline, serve_engines, stage2_config

REPO = Path(__file__).resolve().parents[2]


def ledger(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(out_dir) / "stage2" / "ledger.jsonl").read_text().splitlines()]


def stage2_metrics(out_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("phase") == "stage2" and "loss" in r]


def key(rows: list[dict], fields=("epoch", "sample_id", "step", "rollout_step")) -> list[tuple]:
    return [tuple(r[f] for f in fields) for r in rows]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from trainer.data.synthetic import generate
    from trainer.modeling.fixtures import save_tiny_model

    root = tmp_path_factory.mktemp("async")
    model_dir = save_tiny_model(root / "tiny-text", "text", seed=0)  # the servers' tokenizer = the learner's
    data = generate(root / "data", 12, seed=0, min_objects=1, max_objects=2)
    return root, model_dir, data


def decodes_while_training(timeline, engines) -> int:
    """How many server decodes started while the learner was not waiting on rollouts (it was training, or pushing
    weights): the decodes that overlapped its work. Server and learner share this process's perf_counter."""
    waits = [(a, b) for kind, a, b in timeline if kind == "wait"]
    starts = [t0 for e in engines for t0, _, _ in e.intervals]
    return sum(not any(a <= t0 <= b for a, b in waits) for t0 in starts)


def test_overlap_cuts_learner_idle_and_keeps_the_ledger(assets):
    root, model_dir, data = assets
    runs = {}
    for on in (False, True):
        engines = [TimedEngine(model_dir, delay_s=0.1) for _ in range(2)]
        with serve_engines(engines) as urls:
            cfg = stage2_config(root / f"idle-{on}", data, urls, async_on=on, steps=6, batch=2)
            summary, timeline = run_with_timeline(cfg)
        assert summary.stage2_steps == 6
        runs[on] = (decodes_while_training(timeline, engines), ledger(root / f"idle-{on}"),
                    stage2_metrics(root / f"idle-{on}"))
    (plain, plain_ledger, _), (overlap, overlap_ledger, overlap_metrics) = runs[False], runs[True]
    assert key(overlap_ledger) == key(plain_ledger), "same samples, same order, same steps"
    counts = Counter(r["sample_id"] for r in overlap_ledger)
    assert len(counts) == 12 and set(counts.values()) == {1}, counts
    assert all(r["decode_step"] == max(r["step"] - 1, 0) for r in overlap_ledger), "one step off-policy"
    assert all(r["decode_step"] == r["step"] for r in plain_ledger)
    assert [m["rollout/staleness_max"] for m in overlap_metrics] == [0.0] + [1.0] * 5
    assert sum(m.get("rollout/prefetch_used", 0) for m in overlap_metrics) == 5
    ahead = [m.get("time/target_ahead_s", 0.0) > 0 for m in overlap_metrics]
    assert ahead == [False] + [True] * 5, "each prefetched batch's targets were built off the step, after its decode"
    assert not any(m.get("time/target_ahead_s") for m in runs[False][2])
    for m in runs[False][2] + overlap_metrics:  # the push's parts are sub-phases of the step's weight_sync
        parts = {p: m[f"time/sync_{p}_s"] for p in ("learner_check", "wait_decodes", "collect", "push")}
        assert parts["collect"] > 0 and parts["push"] > 0, parts
        assert sum(parts.values()) <= m["time/weight_sync_s"], (parts, m["time/weight_sync_s"])
    # the events, not their durations (the idle time overlap saves: benchmarks/layouts.yaml's 1v1-sync / 1v1-async):
    # without overlap every decode runs while the learner waits for it; with it, the prefetched decodes (5, one
    # per step after the first) are posted before the step trains, and start while it does
    assert plain == 0, f"{plain} decode(s) started while the learner was not waiting, without async_rollouts"
    assert overlap >= 1, "no decode overlapped the learner's training with async_rollouts"


def test_staleness_bound_zero_decodes_every_step_on_its_own_weights(assets):
    """A step's records are decoded in one call, so with max_staleness_steps 0 no decode is issued ahead."""
    root, model_dir, data = assets
    engines = [TimedEngine(model_dir, delay_s=0.1)]
    with serve_engines(engines) as urls:
        cfg = stage2_config(root / "bound", data, urls, async_on=True, max_staleness=0, steps=3, batch=2, ga=2)
        run_with_timeline(cfg)
    rows = ledger(root / "bound")
    assert all(r["decode_step"] == r["step"] for r in rows), "max_staleness_steps 0: never decoded on older weights"
    counts = Counter(r["sample_id"] for r in rows)
    assert len(counts) == 12 and set(counts.values()) == {1}
    m = stage2_metrics(root / "bound")
    assert max(x["rollout/staleness_max"] for x in m) == 0.0
    assert sum(x.get("rollout/prefetch_used", 0) for x in m) == 0, "nothing decoded ahead of its step's weights"
    assert sum(x.get("rollout/prefetch_skipped", 0) for x in m) == 2, "steps 1 and 2 were not prefetched"


def test_server_stalled_during_an_overlapped_decode_is_quarantined_and_nothing_lost(assets, serve):
    from trainer.server.app import create_app

    root, model_dir, data = assets
    # the stalled server's 2nd call is the prefetch of step 1, issued while step 0 trains; it hangs until the next
    # request reaches that server (the learner's re-admission probe, after it gave up on the call)
    engines = [TimedEngine(model_dir, delay_s=0.05) for _ in range(3)]
    stall = Stall(engines[1], calls={2})
    apps = [create_app(engines[0]), stall.app(create_app(engines[1])), create_app(engines[2])]
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Collect(logging.INFO)
    client_log = logging.getLogger("trainer.rollout")  # client + fleet
    client_log.addHandler(handler)
    try:
        with contextlib.ExitStack() as stack:
            urls = [stack.enter_context(serve(app)) for app in apps]
            stack.callback(stall.release)  # before the servers shut down (after a failure the stall may still hold)
            cfg = stage2_config(root / "stall", data, urls, async_on=True, steps=4, batch=3,
                                infer_timeout_s=INFER_TIMEOUT_S, readmit_after_s=0.01)
            summary, _ = run_with_timeline(cfg)
    finally:
        client_log.removeHandler(handler)
    assert summary.stage2_steps == 4
    text = "\n".join(messages)
    assert stall.stalled.is_set(), f"the stalled server's 2nd decode never came:\n{text}"
    assert f"quarantining rollout server {urls[1]}" in text and "timed out" in text, text
    rows = ledger(root / "stall")
    counts = Counter(r["sample_id"] for r in rows)
    assert len(counts) == 12 and set(counts.values()) == {1}, counts
    assert all(r["decode_step"] == max(r["step"] - 1, 0) for r in rows)


@pytest.mark.slow
def test_sigkill_mid_overlap_resumes_exactly(assets):
    """A learner SIGKILLed while the servers decode its next batch resumes from the last checkpoint, whose rollout
    state holds the prefetched batch finished: the ledger (decode step included) and losses match a straight run."""
    root, model_dir, data = assets
    engines = [TimedEngine(model_dir, delay_s=0.3) for _ in range(2)]
    with serve_engines(engines) as urls:
        straight = stage2_config(root / "straight", data, urls, async_on=True, steps=6, batch=2, save_steps=3)
        run_with_timeline(straight)
        killed = stage2_config(root / "killed", data, urls, async_on=True, steps=6, batch=2, save_steps=3)
        config = root / "killed.yaml"
        config.write_text(yaml.safe_dump(killed))
        cmd = [sys.executable, "-m", "trainer", "train", "--config", str(config)]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        marker = root / "killed" / "stage2" / "checkpoint-3" / "rank0-rollout_state.pt"
        deadline = time.monotonic() + 900  # bounds a hang only
        while not marker.exists():
            assert proc.poll() is None, f"learner exited ({proc.returncode}) before writing checkpoint-3"
            assert time.monotonic() < deadline, "learner never wrote checkpoint-3 (waited 900 s)"
            time.sleep(0.01)
        # from now on the servers hold every decode until the kill: steps 5 and 6 need one, so the learner cannot
        # get past its next decode, and is killed while the servers decode its next batch (mid-overlap)
        stalls = [Stall(e) for e in engines]
        try:
            while not any(s.stalled.is_set() for s in stalls):
                assert proc.poll() is None, f"learner exited ({proc.returncode}) without a decode after checkpoint-3"
                assert time.monotonic() < deadline, "no decode reached the servers after checkpoint-3 (900 s)"
                time.sleep(0.01)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        finally:
            for s in stalls:
                s.release()
        subprocess.run(cmd + ["--resume-from-checkpoint", "latest"], check=True, env=env, capture_output=True,
                       timeout=900)
    fields = ("epoch", "sample_id", "step", "rollout_step", "decode_step")
    assert key(ledger(root / "killed"), fields) == key(ledger(root / "straight"), fields)
    resumed = {m["step"]: m["loss"] for m in stage2_metrics(root / "killed")}
    plain = {m["step"]: m["loss"] for m in stage2_metrics(root / "straight")}
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(plain[step], rel=1e-4), (step, resumed, plain)
