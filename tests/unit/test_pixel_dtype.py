"""Pixel values kept in a 16-bit model's dtype (``PromptEncoder(pixel_dtype=...)``): the vision tower casts them to
its weights' dtype first thing, so a bf16 Qwen3-VL gives the same image features from bf16 pixels as from float32
ones, while every copy of the pixels (packing, host to GPU, carry, rollout buffer) moves half the bytes."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from trainer.data.records import Sample
from trainer.modeling.fixtures import save_tiny_model
from trainer.modeling.prompts import PromptEncoder


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from trainer.modeling.loading import load_image_processor

    d = save_tiny_model(tmp_path_factory.mktemp("vl") / "tiny-vl", "vl", seed=0)
    model = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.bfloat16).eval()
    return (AutoTokenizer.from_pretrained(d), load_image_processor(d)), model


def _sample(tmp_path) -> Sample:
    path = tmp_path / "img.png"
    Image.effect_noise((96, 64), 80).convert("RGB").save(path)
    return Sample("s0", (str(path),), 96, 64, ())


def test_bf16_pixels_give_the_same_image_features(vl, tmp_path):
    (tok, images), model = vl
    sample = _sample(tmp_path)
    full = PromptEncoder(tok, images).encode(sample)
    half = PromptEncoder(tok, images, pixel_dtype=torch.bfloat16).encode(sample)
    assert full.input_ids == half.input_ids
    p32, p16 = full.mm_inputs["pixel_values"], half.mm_inputs["pixel_values"]
    assert p32.dtype == torch.float32 and p16.dtype == torch.bfloat16
    assert p16.element_size() * p16.numel() * 2 == p32.element_size() * p32.numel()
    assert torch.equal(p16, p32.to(torch.bfloat16))
    grid = full.mm_inputs["image_grid_thw"]
    with torch.no_grad():
        a = model.model.get_image_features(p32, grid)
        b = model.model.get_image_features(p16, grid)
    a = a.pooler_output if hasattr(a, "pooler_output") else a
    b = b.pooler_output if hasattr(b, "pooler_output") else b
    for x, y in zip(a, b):
        assert torch.equal(x, y), "a bf16 vision tower sees the same values either way"


def test_pixel_dtype_must_be_16_bit(vl):
    (tok, images), _ = vl
    with pytest.raises(ValueError, match="16-bit"):
        PromptEncoder(tok, images, pixel_dtype=torch.float64)
