"""The version/platform shims of ``trainer.rollout.vllm_compat`` that CI can check without a GPU.

- LoRA wrappers are swapped for their base layers while weights load (vLLM 0.26's ``AutoWeightsLoader`` cannot load
  ``embed_tokens.weight`` into ``embed_tokens.base_layer.weight``: the full-sync failure seen on the H100), and put
  back afterwards, also when the load raises.
- Expanded image-pad runs are collapsed to the single placeholder vLLM expands itself (on the H100 vLLM re-expanded
  the first pad of an expanded run: 3 extra prompt tokens for a 4-pad image).
"""

from __future__ import annotations

import pytest
import torch

from trainer.rollout.vllm_compat import collapse_image_placeholders, lora_wrappers_removed

pytestmark = pytest.mark.vllm


def _model():
    from vllm.lora.layers import BaseLayerWithLoRA

    class Wrapped(BaseLayerWithLoRA):
        def __init__(self, base):
            torch.nn.Module.__init__(self)
            self.base_layer = base

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = Wrapped(torch.nn.Embedding(8, 4))
            self.proj = Wrapped(torch.nn.Linear(4, 4))
            self.norm = torch.nn.LayerNorm(4)

    model = torch.nn.Module()
    model.model = Block()
    model.lm_head = model.model.embed_tokens.base_layer  # tied: shares the base module, not the wrapper
    return model


def test_lora_wrappers_are_swapped_for_their_base_layers_while_loading_and_restored():
    model = _model()
    wrapped = {n for n, _ in model.named_parameters()}
    assert "model.embed_tokens.base_layer.weight" in wrapped and "model.embed_tokens.weight" not in wrapped
    embed = model.model.embed_tokens
    with lora_wrappers_removed(model) as n:
        assert n == 2
        names = {k for k, _ in model.named_parameters()}
        assert {"model.embed_tokens.weight", "model.proj.weight", "model.proj.bias", "model.norm.weight"} <= names
        with torch.no_grad():  # what a checkpoint-named load does: it lands in the wrapper's base layer
            model.get_parameter("model.embed_tokens.weight").fill_(3.0)
    assert model.model.embed_tokens is embed and {n for n, _ in model.named_parameters()} == wrapped
    assert torch.equal(embed.base_layer.weight, torch.full((8, 4), 3.0)) and model.lm_head is embed.base_layer
    with pytest.raises(RuntimeError, match="load failed"), lora_wrappers_removed(model):
        raise RuntimeError("load failed")
    assert model.model.embed_tokens is embed, "wrappers are restored when the load raises"


def test_expanded_image_pad_runs_collapse_to_one_placeholder_per_image():
    pad, start, end = 9, 7, 8
    ids = [1, start, pad, pad, pad, pad, end, 2, start, pad, pad, end, 3]
    assert collapse_image_placeholders(ids, pad) == [1, start, pad, end, 2, start, pad, end, 3]
    assert collapse_image_placeholders([1, 2, 3], pad) == [1, 2, 3]
