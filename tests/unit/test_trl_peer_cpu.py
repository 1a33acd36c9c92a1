"""``trainer.bench.trl_peer`` (TRL's GRPOTrainer, the scale bench's peer) on the CPU: two GRPO steps on a tiny random
Qwen3-VL with images, HF generate instead of vLLM, with and without ``use_liger_kernel``.

TRL 0.29.1's Liger loss path calls ``model.model`` without ``mm_token_type_ids``, which Qwen3-VL in transformers >=
5.17 needs for M-RoPE whenever images are passed (ValueError at the first step); trl_peer hands them over. Liger's
kernels need Triton and a GPU, so the Liger run here swaps ``LigerFusedLinearGRPOLoss`` for a plain-torch GRPO loss
with its call signature: the model calls (TRL's ``compute_liger_loss`` / ``_get_last_hidden_state``) are TRL's own."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed: trl_peer runs TRL's GRPOTrainer")
grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer", reason="TRL without trl.trainer.grpo_trainer")

from trainer.bench import models, trl_peer  # noqa: E402
from trainer.data import synthetic  # noqa: E402

STEPS = 2


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory) -> tuple[Path, Path]:
    work = tmp_path_factory.mktemp("trl_peer")
    model_dir, _ = models.save_random_vl_model(work / "model", "tiny", "cpu")
    # 32x32 images: 4 patches of 16 px, one visual token after the 2x2 merge
    data = synthetic.generate(work / "data", num_samples=4, seed=0, image_size=32)
    return model_dir, data


class PlainGRPOLoss:
    """Stand-in for ``liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss`` (same constructor and call keywords):
    the token-level GRPO surrogate on ``hidden @ lm_head``, no clipping (one update per generation)."""

    calls = 0

    def __init__(self, temperature: float = 1.0, **_: object) -> None:
        self.temperature = temperature

    def __call__(self, _input, lin_weight, selected_token_ids, attention_mask, advantages, bias=None, **_):
        PlainGRPOLoss.calls += 1
        logits = _input @ lin_weight.T + (bias if bias is not None else 0.0)
        logps = torch.log_softmax(logits.float() / self.temperature, dim=-1)
        logps = logps.gather(-1, selected_token_ids.unsqueeze(-1)).squeeze(-1)
        per_token = -torch.exp(logps - logps.detach()) * advantages.unsqueeze(1)
        mask = attention_mask.float()
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0), (torch.zeros((), device=_input.device),)


def _run(model_dir: Path, data: Path, out: Path, liger: bool) -> dict:
    result = trl_peer.run(model_dir, data, out, steps=STEPS, batch=2, max_new_tokens=4, vllm_util=0.3, use_vllm=False,
                          lora_rank=0, liger=liger)
    written = json.loads(out.read_text())
    assert written["steps"] == result["steps"] == STEPS
    for key in ("step_s", "step_wall_s"):
        assert math.isfinite(written[key]) and written[key] > 0.0, (key, written[key])
        assert len(written[f"{key}_runs"]) == STEPS
    assert written["use_liger_kernel"] is liger
    # two prompts of one 32 px image each, two completions of 1..4 tokens, per step
    prompt, completion, padded = (written[f"{k}_tokens_runs"] for k in ("prompt", "completion", "padded"))
    assert len(prompt) == len(completion) == len(padded) == STEPS
    for p, c, pad in zip(prompt, completion, padded):
        assert 2 <= c <= 2 * 4 and p > 2 and p + c <= pad
    assert written["train_tokens"] == pytest.approx(prompt[-1] + completion[-1])  # the steady mean: steps 2..
    return written


def test_trl_grpo_runs_on_a_tiny_qwen3_vl_with_images(model_and_data, tmp_path):
    model_dir, data = model_and_data
    _run(model_dir, data, tmp_path / "trl.json", liger=False)


def test_trl_liger_loss_path_gets_mm_token_type_ids(model_and_data, tmp_path, monkeypatch):
    import transformers.trainer

    model_dir, data = model_and_data
    monkeypatch.setattr(grpo_trainer, "is_liger_kernel_available", lambda *a, **k: True)
    monkeypatch.setattr(grpo_trainer, "LigerFusedLinearGRPOLoss", PlainGRPOLoss, raising=False)
    # HF Trainer would patch RoPE / RMSNorm / SwiGLU with Liger's Triton kernels: not on a CPU
    monkeypatch.setattr(transformers.trainer, "apply_liger_kernel", lambda *a, **k: None)
    handed: list[tuple[str, torch.Tensor]] = []
    original = trl_peer.mm_token_types_into

    def spy(module, mm_token_type_ids):
        handed.append((type(module).__name__, mm_token_type_ids))
        return original(module, mm_token_type_ids)

    monkeypatch.setattr(trl_peer, "mm_token_types_into", spy)
    PlainGRPOLoss.calls = 0
    _run(model_dir, data, tmp_path / "trl-liger.json", liger=True)
    assert PlainGRPOLoss.calls == STEPS, "the Liger loss path ran once per step"
    assert [name for name, _ in handed] == ["Qwen3VLModel"] * STEPS
    for _, mm in handed:  # the processor's types over prompt + completion: one image token (32 px, 2x2 merge) a row
        assert mm is not None and mm.shape[0] == 2 and mm.sum(dim=1).tolist() == [1, 1]


def test_vision_special_tokens_are_kept_out_of_trl_s_completions(model_and_data):
    """2026-11-27 (8B, H200): TRL's random-model completions held one ``<|image_pad|>``, and its forward over prompt +
    completion refused the step (8193 image tokens, 8192 features). The peer bans the vision tokens in sampling."""
    model_dir, _ = model_and_data
    tok = trl_peer.processor_for(model_dir).tokenizer
    ids = trl_peer.vision_token_ids(tok)
    assert sorted(tok.convert_ids_to_tokens(ids)) == sorted(trl_peer.VISION_SPECIAL_TOKENS)
    assert trl_peer.suppressed_tokens_kwargs(ids, use_vllm=True) == {"logit_bias": {i: -100.0 for i in ids}}
    assert trl_peer.suppressed_tokens_kwargs(ids, use_vllm=False) == {"suppress_tokens": ids}
    assert trl_peer.suppressed_tokens_kwargs([], use_vllm=True) == {}
    from transformers import GenerationConfig
    from transformers.generation.logits_process import SuppressTokensLogitsProcessor

    cfg = GenerationConfig(**trl_peer.suppressed_tokens_kwargs(ids, use_vllm=False))
    scores = SuppressTokensLogitsProcessor(cfg.suppress_tokens)(torch.zeros(1, 3), torch.zeros(1, len(tok)))
    assert torch.isinf(scores[0, ids]).all() and torch.isfinite(scores[0, [i for i in range(8) if i not in ids]]).all()
