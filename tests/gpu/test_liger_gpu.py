"""GPU-only (run on the device machine, never in CI): ``training.use_liger_kernel`` (liger-kernel 0.8.5's Triton
RMSNorm, SwiGLU and RoPE) gives the unfused model's loss and gradients on packed rows: the tiny Qwen3-VL with its
per-segment 3-D mRoPE position ids (and the tiny Qwen3 text model), the project's chunked supervised objective.

Run: ``pip install 'rollout-matching[liger]'; python -m pytest -m gpu tests/gpu/test_liger_gpu.py``."""

from __future__ import annotations

import tempfile

import pytest
import torch

from trainer.data.records import load_jsonl
from trainer.data.synthetic import generate
from trainer.losses.objective import LossWeights
from trainer.modeling.fixtures import build_tiny_image_processor, build_tiny_model
from trainer.modeling.liger import apply_liger_kernel
from trainer.modeling.prompts import PromptEncoder
from trainer.packing.packed_batch import pack_targets
from trainer.sft.forward import forward_loss
from trainer.sft.stage2 import Stage2Pipeline

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton kernels)")]


@pytest.fixture
def module_globals_restored(monkeypatch):
    """Liger swaps ``apply_rotary_pos_emb`` (and the RMSNorm class) module-wide; put them back after the test."""
    from transformers.models.qwen3 import modeling_qwen3
    from transformers.models.qwen3_vl import modeling_qwen3_vl

    for module, names in ((modeling_qwen3_vl, ("apply_rotary_pos_emb", "apply_rotary_pos_emb_vision",
                                               "Qwen3VLTextRMSNorm")),
                          (modeling_qwen3, ("apply_rotary_pos_emb", "Qwen3RMSNorm", "Qwen3MLP"))):
        for name in names:
            monkeypatch.setattr(module, name, getattr(module, name))
    return modeling_qwen3_vl, modeling_qwen3


@pytest.mark.parametrize("kind", ["vl", "text"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_liger_matches_the_unfused_loss_and_gradients_on_packed_rows(kind, dtype, module_globals_restored):
    pytest.importorskip("liger_kernel.transformers", reason="pip install 'rollout-matching[liger]'")
    from liger_kernel.transformers import LigerRMSNorm, LigerSwiGLUMLP, liger_rotary_pos_emb

    samples = load_jsonl(generate(tempfile.mkdtemp(), 4, seed=4, max_objects=3))
    reference, tok = build_tiny_model(kind, seed=2)
    fused, _ = build_tiny_model(kind, seed=2)
    pipe = Stage2Pipeline(PromptEncoder(tok, build_tiny_image_processor() if kind == "vl" else None))
    targets = pipe.ground_truth_targets(samples)
    image_token_id = getattr(reference.config, "image_token_id", None)
    batch = pack_targets(targets, "sdpa", reference, image_token_id)  # one row, block-diagonal causal mask
    lengths = [t.length for t in targets]
    if kind == "vl":
        pos = batch["position_ids"]
        assert pos.shape == (3, 1, sum(lengths)) and (pos[0, 0, lengths[0]] == 0).item(), \
            "3-D mRoPE ids, restarting at each segment"
    coord_ids = torch.tensor(sorted(pipe.coord_bin_by_id, key=pipe.coord_bin_by_id.get), device="cuda")

    def loss_and_grads(model):
        model.to("cuda", dtype).train()
        b = {k: (v.to("cuda") if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        if "pixel_values" in b:
            b["pixel_values"] = b["pixel_values"].to(dtype)
        model.zero_grad(set_to_none=True)
        loss, _, _ = forward_loss(model, b, coord_ids, LossWeights(), supervised_logits=True, logit_chunk_rows=64)
        loss.backward()
        return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}

    ref_loss, ref_grads = loss_and_grads(reference)  # before the module-wide RoPE swap
    applied = apply_liger_kernel(fused)
    modeling = module_globals_restored[0] if kind == "vl" else module_globals_restored[1]
    assert modeling.apply_rotary_pos_emb is liger_rotary_pos_emb
    text = fused.model.language_model if kind == "vl" else fused.model
    assert applied["swiglu_mlps"] == len(text.layers)
    assert all(layer.mlp.forward.__func__ is LigerSwiGLUMLP.forward for layer in text.layers)
    norms = [text.norm] + [m for layer in text.layers for m in (layer.input_layernorm, layer.post_attention_layernorm,
                                                                 layer.self_attn.q_norm, layer.self_attn.k_norm)]
    assert all(m.forward.__func__ is LigerRMSNorm.forward for m in norms), "the instance's norms run Liger's"
    calls = []
    real = modeling.apply_rotary_pos_emb
    modeling.apply_rotary_pos_emb = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    fused_loss, fused_grads = loss_and_grads(fused)
    assert len(calls) == len(text.layers), "every text layer rotated q / k with Liger's kernel"

    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fused_loss, ref_loss, **tol)
    assert fused_grads.keys() == ref_grads.keys() and ref_grads

    def rel_err(a, b):
        return float((a - b).norm() / b.norm().clamp_min(1e-12))

    worst = max(rel_err(fused_grads[n], g) for n, g in ref_grads.items())
    assert worst < (1e-3 if dtype == torch.float32 else 5e-2), worst
