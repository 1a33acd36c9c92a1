"""GPU-only (run on the device machine, never in CI): packed rows through PyTorch varlen attention give the
same per-sample losses as the padded forward on the tiny text model. (Qwen3-VL packs with the block mask:
with transformers 5.17 the varlen kwargs break its vision encoder — see docs/concepts/packing.md.)

Run: ``python -m pytest -m gpu tests/gpu``."""

from __future__ import annotations

import contextlib
import tempfile

import pytest
import torch

from trainer.data.records import load_jsonl
from trainer.data.synthetic import generate
from trainer.losses.objective import LossWeights, per_segment_losses
from trainer.modeling.fixtures import build_tiny_image_processor, build_tiny_model
from trainer.modeling.prompts import PromptEncoder
from trainer.packing.batching import pad_targets
from trainer.packing.packed_batch import pack_targets
from trainer.packing.varlen_attention import packed_attention, register_varlen_attention, varlen_available
from trainer.sft.forward import LOSS_KEYS
from trainer.sft.stage2 import Stage2Pipeline

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not varlen_available(), reason="needs CUDA + torch varlen attention")]


@pytest.mark.parametrize("kind", ["text", "vl"])
def test_varlen_packed_matches_padded(kind, monkeypatch):
    from trainer.packing import varlen_attention

    calls = []
    real = varlen_attention.varlen_attention

    def counting(*args, **kwargs):
        calls.append(args[3].tolist())
        return real(*args, **kwargs)

    monkeypatch.setattr(varlen_attention, "varlen_attention", counting)
    samples = load_jsonl(generate(tempfile.mkdtemp(), 4, seed=4, max_objects=3))
    model, tok = build_tiny_model(kind, seed=2)
    pipe = Stage2Pipeline(PromptEncoder(tok, build_tiny_image_processor() if kind == "vl" else None))
    targets = pipe.ground_truth_targets(samples)
    image_token_id = getattr(model.config, "image_token_id", None)
    coord_ids = torch.tensor(sorted(pipe.coord_bin_by_id, key=pipe.coord_bin_by_id.get), device="cuda")
    impl = register_varlen_attention()

    def to_cuda(b):
        return {k: (v.to("cuda") if isinstance(v, torch.Tensor) else v) for k, v in b.items()}

    padded = to_cuda(pad_targets(targets, tok.pad_token_id, image_token_id))
    packed = to_cuda(pack_targets(targets, impl, model, image_token_id))
    model = model.to("cuda", torch.bfloat16)
    if "pixel_values" in padded:
        padded["pixel_values"] = padded["pixel_values"].to(torch.bfloat16)
        packed["pixel_values"] = packed["pixel_values"].to(torch.bfloat16)
    with torch.no_grad():
        lp = model(**{k: v for k, v in padded.items() if k not in LOSS_KEYS}).logits.float()
        with packed_attention(model, impl, packed.get("packed_cu_seq_lens"), packed.get("packed_max_length")):
            lk = model(**{k: v for k, v in packed.items() if k not in LOSS_KEYS}).logits.float()
    assert ("packed_cu_seq_lens" in packed) == (kind == "vl") and ("cu_seq_lens_q" in packed) == (kind == "text")
    cu = [0, *torch.cumsum(torch.tensor([t.length for t in targets]), 0).tolist()]
    layers = model.config.get_text_config().num_hidden_layers
    assert calls == [cu] * layers, "every text layer ran the varlen kernel with the segment boundaries"
    a = per_segment_losses(lp, padded, coord_ids, LossWeights())
    b = per_segment_losses(lk, packed, coord_ids, LossWeights())
    assert torch.allclose(a, b, rtol=2e-2, atol=2e-2), (a, b)



def test_varlen_packed_gradients_match_padded_with_activation_checkpointing():
    """The packed layout must stay on through backward: checkpointing recomputes the forward there."""
    from trainer.sft.forward import forward_loss

    samples = load_jsonl(generate(tempfile.mkdtemp(), 4, seed=6, max_objects=3))
    model, tok = build_tiny_model("text", seed=2)
    pipe = Stage2Pipeline(PromptEncoder(tok))
    targets = pipe.ground_truth_targets(samples)
    coord_ids = torch.tensor(sorted(pipe.coord_bin_by_id, key=pipe.coord_bin_by_id.get), device="cuda")
    impl = register_varlen_attention()
    model = model.to("cuda", torch.bfloat16).train()
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def grads(batch, layout):
        model.zero_grad(set_to_none=True)
        batch = {k: (v.to("cuda") if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        with layout:
            loss, _, _ = forward_loss(model, batch, coord_ids, LossWeights(), supervised_logits=True)
            loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    g_packed = grads(pack_targets(targets, impl), packed_attention(model, impl))
    g_padded = grads(pad_targets(targets, tok.pad_token_id), contextlib.nullcontext())
    assert g_packed.keys() == g_padded.keys() and g_packed

    def rel_err(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))

    worst = max(rel_err(g_packed[n], g) for n, g in g_padded.items())
    assert worst < 0.05, worst

    model.zero_grad(set_to_none=True)
    packed = {k: (v.to("cuda") if isinstance(v, torch.Tensor) else v) for k, v in pack_targets(targets, impl).items()}
    with packed_attention(model, impl):
        loss, _, _ = forward_loss(model, packed, coord_ids, LossWeights(), supervised_logits=True)
    try:
        loss.backward()
    except Exception as exc:  # checkpoint recompute without the layout: a tensor-count mismatch
        assert "checkpoint" in type(exc).__module__ + str(exc).lower()
    else:
        outside = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        assert max(rel_err(outside[n], g) for n, g in g_padded.items()) > 0.05, "backward outside the layout differs"
