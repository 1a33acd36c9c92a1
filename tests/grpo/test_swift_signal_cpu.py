"""End to end on CPU (slow): ms-swift's GRPO learner (``swift rlhf``, argv built as the ms-swift conformance check builds it, plus
``signal.length_distinct`` through its plugin) at random weights, sampling at ``GRPO_TEMPERATURE``, has a learning
signal: in every step the completions of a prompt score differently (reward_std > 0, frac_reward_zero_std < 1) and
the gradient is not 0, read from ms-swift's logs by the harness's own parser.

What differs from the conformance check on GPUs, and why: as in ``test_swift_grpo_cpu.py`` a tiny text Qwen3 on a text-only
copy of the rows, generation by the learner itself (``use_vllm: false``: server mode needs NCCL, i.e. GPUs), no
bf16, tiny batch sizes."""

from __future__ import annotations

import json

import pytest

from tests.grpo.conftest import tiny_text_grpo_config
from trainer.conformance import peers, rlhf, rollout, swift_logs

pytestmark = pytest.mark.slow


def test_swift_rlhf_at_random_weights_has_a_learning_signal(tmp_path, summary_dataset):
    pytest.importorskip("swift", reason="ms-swift is not installed (make setup installs it via mk/grpo.mk)")
    cfg, out_dir = tiny_text_grpo_config(tmp_path, summary_dataset, rlhf.SUMMARY_CONFIG, batch=4, rlhf={
        "num_generations": 4, "generation_batch_size": 4, "max_completion_length": 32,
        "temperature": rlhf.GRPO_TEMPERATURE})
    argv, env = rlhf.rlhf_command(cfg)
    argv = rlhf.with_signal_reward(argv)
    env["MASTER_PORT"] = str(rollout.free_port())
    log = tmp_path / "logs" / "swift_rlhf.log"
    rec = peers.run_logged(argv, log, timeout_s=900, env=peers.peer_env(env), cwd=tmp_path)
    text = log.read_text(errors="replace")
    assert rec["rc"] == 0, text[-6000:]
    jsonl = [json.loads(x) for x in next(out_dir.glob("*/logging.jsonl")).read_text().splitlines() if x.strip()]
    steps = swift_logs.step_metrics(jsonl)
    console = swift_logs.step_metrics(swift_logs.log_records(text))  # the console log says the same, to its 4 digits
    assert [(c["step"], c["varying_rewards"]) for c in console] == [(s["step"], s["varying_rewards"]) for s in steps]
    for c, s in zip(console, steps):
        for k in ("reward", "reward_std", "loss", "grad_norm", "signal_reward_std"):
            assert c[k] == pytest.approx(s[k], rel=1e-3, abs=1e-6), (k, c, s)
    assert [s["step"] for s in steps] == [1, 2], steps
    assert all(s["signal_reward_std"] > 0 and "LengthDistinctReward" in s["varying_rewards"] for s in steps), steps
    sig = swift_logs.learning_signal(steps)
    print(swift_logs.learning_signal_line(sig, steps))
    assert sig["ok"], (sig, steps)
    assert sig["nonzero_grad_norm_steps"] == 2 and sig["reward_std_min"] > 0
    assert swift_logs.learning_signal(console)["ok"]
