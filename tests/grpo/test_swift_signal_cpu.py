"""End to end on CPU (slow): ms-swift's GRPO learner (``swift rlhf``, argv built as the peers bench builds it, plus
``signal.length_distinct`` through its plugin) at random weights, sampling at ``GRPO_TEMPERATURE``, has a learning
signal: in every step the completions of a prompt score differently (reward_std > 0, frac_reward_zero_std < 1) and
the gradient is not 0, read from ms-swift's logs by the harness's own parser.

What differs from the bench on GPUs, and why: as in ``test_swift_grpo_cpu.py`` a tiny text Qwen3 on a text-only
copy of the rows, generation by the learner itself (``use_vllm: false``: server mode needs NCCL, i.e. GPUs), no
bf16, tiny batch sizes."""

from __future__ import annotations

import json

import pytest

from tests.grpo.conftest import tiny_text_grpo_config
from trainer.bench import swift_peers as sp

pytestmark = pytest.mark.slow


def test_swift_rlhf_at_random_weights_has_a_learning_signal(tmp_path, summary_dataset):
    pytest.importorskip("swift", reason="ms-swift is not installed (make setup installs it via mk/grpo.mk)")
    cfg, out_dir = tiny_text_grpo_config(tmp_path, summary_dataset, sp.SUMMARY_CONFIG, batch=4, rlhf={
        "num_generations": 4, "generation_batch_size": 4, "max_completion_length": 32,
        "temperature": sp.GRPO_TEMPERATURE})
    argv, env = sp.rlhf_command(cfg)
    argv = sp.with_signal_reward(argv)
    env["MASTER_PORT"] = str(sp.free_port())
    log = tmp_path / "logs" / "swift_rlhf.log"
    rec = sp.run_logged(argv, log, timeout_s=900, env=sp.peer_env(env), cwd=tmp_path)
    text = log.read_text(errors="replace")
    assert rec["rc"] == 0, text[-6000:]
    jsonl = [json.loads(x) for x in next(out_dir.glob("*/logging.jsonl")).read_text().splitlines() if x.strip()]
    steps = sp.step_metrics(jsonl)
    console = sp.step_metrics(sp.log_records(text))  # the console log says the same, to its 4 digits
    assert [(c["step"], c["varying_rewards"]) for c in console] == [(s["step"], s["varying_rewards"]) for s in steps]
    for c, s in zip(console, steps):
        for k in ("reward", "reward_std", "loss", "grad_norm", "signal_reward_std"):
            assert c[k] == pytest.approx(s[k], rel=1e-3, abs=1e-6), (k, c, s)
    assert [s["step"] for s in steps] == [1, 2], steps
    assert all(s["signal_reward_std"] > 0 and "LengthDistinctReward" in s["varying_rewards"] for s in steps), steps
    sig = sp.learning_signal(steps)
    print(sp.learning_signal_line(sig, steps))
    assert sig["ok"], (sig, steps)
    assert sig["nonzero_grad_norm_steps"] == 2 and sig["reward_std_min"] > 0
    assert sp.learning_signal(console)["ok"]
