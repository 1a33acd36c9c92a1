"""End to end on CPU: ``python -m trainer launch learner`` execs ms-swift's ``swift rlhf`` (GRPO) built from
``summary_1024_attr_key_recall.yaml``, which trains two steps on the synthetic summary data with every summary
reward loaded through our plugin (``schema_tree`` derived from the dataset the launcher names).

What differs from production, and why: a tiny text Qwen3 (the Qwen3-VL processor needs torchvision, which
cannot load beside the CPU torch here) on a text-only copy of the rows, generation by the learner itself
(``use_vllm: false``: server mode needs NCCL weight sync, i.e. GPUs), no DeepSpeed/bf16, tiny batch sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.grpo.conftest import REPO, tiny_text_grpo_config
from trainer.grpo.rewards import REWARD_NAMES

pytestmark = pytest.mark.slow


def test_swift_rlhf_grpo_two_steps_with_summary_rewards(tmp_path, summary_dataset):
    pytest.importorskip("swift", reason="ms-swift is not installed (make setup installs it via mk/grpo.mk)")
    cfg, out_dir = tiny_text_grpo_config(tmp_path, summary_dataset, "configs/summary_1024_attr_key_recall.yaml", batch=2,
                                         rlhf={"num_generations": 2, "generation_batch_size": 4,
                                               "max_completion_length": 24})
    # PYTHONFAULTHANDLER: a rare abort at swift's exit under the full suite's load prints every thread's stack
    env = dict(os.environ, VLLM_PLUGINS="", TOKENIZERS_PARALLELISM="false", USE_HF="1", HF_HUB_OFFLINE="1",
               PYTHONFAULTHANDLER="1", PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NPROC_PER_NODE", "SUMMARY_SCHEMA_DATASET"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-m", "trainer", "launch", "learner", "--config", str(cfg)], cwd=tmp_path,
                          env=dict(env, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert "launch: exec " in log and " swift rlhf " in log
    logs = list(out_dir.glob("*/logging.jsonl"))
    assert len(logs) == 1, log[-3000:]
    records = [json.loads(x) for x in logs[0].read_text().splitlines()]
    first = next(r for r in records if "reward" in r)
    names = {n: "".join(p.capitalize() for p in n.replace(".", "_").split("_")) + "Reward" for n in REWARD_NAMES}
    cfg_funcs = yaml.safe_load((REPO / "configs/summary_1024_attr_key_recall.yaml").read_text())["rlhf"]["reward_funcs"]
    for fn in cfg_funcs:
        assert f"rewards/{names[fn]}/mean" in first, (fn, sorted(first))
    assert any(r.get("global_step/max_steps") == "2/2" for r in records)
