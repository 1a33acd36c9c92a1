"""Supervised-only logits: same loss and gradients as full [B, T, V] logits, padded and packed, text and VL."""

from __future__ import annotations

import tempfile

import pytest
import torch

from trainer.data.records import load_jsonl
from trainer.data.synthetic import generate
from trainer.losses.objective import LossWeights, host_terms, objective, objective_from_rows
from trainer.losses.supervised_logits import capture_lm_head_input, output_embedding, supervised_rows
from trainer.modeling.fixtures import build_tiny_image_processor, build_tiny_model
from trainer.modeling.prompts import PromptEncoder
from trainer.packing.batching import pad_targets
from trainer.packing.packed_batch import pack_targets
from trainer.sft.forward import LOSS_KEYS
from trainer.sft.stage2 import Stage2Pipeline


def _setup(kind: str):
    samples = load_jsonl(generate(tempfile.mkdtemp(), 3, seed=5, max_objects=3))
    model, tok = build_tiny_model(kind, seed=3)
    model.config._attn_implementation = "sdpa"
    model.get_decoder().config._attn_implementation = "sdpa"
    pipe = Stage2Pipeline(PromptEncoder(tok, build_tiny_image_processor() if kind == "vl" else None))
    targets = pipe.ground_truth_targets(samples)
    coord_ids = torch.tensor(sorted(pipe.coord_bin_by_id, key=pipe.coord_bin_by_id.get))
    return model, tok, targets, coord_ids


def _setup_batch(kind: str, layout: str):
    """``_setup(kind)``'s model, its targets as one ``padded`` or ``packed`` batch, and the coord ids."""
    model, tok, targets, coord_ids = _setup(kind)
    image_token_id = getattr(model.config, "image_token_id", None)
    batch = (pad_targets(targets, tok.pad_token_id, image_token_id) if layout == "padded"
             else pack_targets(targets, "sdpa", model, image_token_id))
    return model, batch, coord_ids


def _loss_and_grads(model, batch, coord_ids, w, supervised: bool):
    model.zero_grad(set_to_none=True)
    inputs = {k: v for k, v in batch.items() if k not in LOSS_KEYS}
    if supervised:
        with capture_lm_head_input(model) as cap:
            out = model(**inputs)
        assert out.logits.shape[-2] == 0, "no logits are projected for the full sequence"
        rows = supervised_rows(cap.hidden, output_embedding(model), batch, coord_ids, coord_only=w.coord_gate == 0)
        loss, terms = objective_from_rows(rows, batch, coord_ids, w)
    else:
        loss, terms = objective(model(**inputs).logits, batch, coord_ids, w)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), host_terms(terms), grads


@pytest.mark.parametrize("kind", ["text", "vl"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("gate", [1.0, 0.0])
def test_supervised_rows_match_full_logits(kind, layout, gate):
    model, batch, coord_ids = _setup_batch(kind, layout)
    w = LossWeights(coord_gate=gate)
    full_loss, full_terms, full_grads = _loss_and_grads(model, batch, coord_ids, w, supervised=False)
    sup_loss, sup_terms, sup_grads = _loss_and_grads(model, batch, coord_ids, w, supervised=True)
    assert full_terms["tokens/ce"] > 0 and full_terms["tokens/coord"] > 0
    assert sup_loss == pytest.approx(full_loss, rel=1e-5)
    assert ("loss/coord_gate" in sup_terms) == (gate > 0), "the gate is reported only where it is computed"
    for key in sup_terms:
        assert sup_terms[key] == pytest.approx(full_terms[key], rel=1e-5, abs=1e-7), key
    assert full_grads.keys() == sup_grads.keys()
    for name, g in full_grads.items():
        assert torch.allclose(sup_grads[name], g, rtol=1e-4, atol=1e-6), name


def test_coord_only_rows_have_only_coord_columns_and_refuse_the_gate():
    model, tok, targets, coord_ids = _setup("text")
    batch = pad_targets(targets, tok.pad_token_id)
    with capture_lm_head_input(model) as cap:
        model(**{k: v for k, v in batch.items() if k not in LOSS_KEYS})
    rows = supervised_rows(cap.hidden, output_embedding(model), batch, coord_ids, coord_only=True)
    assert rows.coord.shape == (batch["coord_index"].shape[0], coord_ids.numel())
    assert rows.ce.shape == (batch["ce_index"].shape[0], model.config.vocab_size)
    with pytest.raises(ValueError, match="coord_gate_weight"):
        objective_from_rows(rows, batch, coord_ids, LossWeights(coord_gate=1.0))


def test_hook_is_removed_even_when_the_forward_fails():
    model, tok, targets, _ = _setup("text")
    head = output_embedding(model)
    with pytest.raises(RuntimeError, match="boom"):
        with capture_lm_head_input(model):
            raise RuntimeError("boom")
    assert not head._forward_pre_hooks
    ids = torch.tensor([targets[0].input_ids])
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], model.config.vocab_size)
