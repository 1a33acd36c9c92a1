"""GPU-only (run on the device machine, never in CI): ``training.host_vision_metadata`` on a CUDA device. The tiny
Qwen3-VL's logits with the grid on the host (the hook making the encoder's metadata there) and the deepstack merge by
the collator's image positions equal those of the model's own derivation, and neither the encoder's body nor the merge
makes a host wait: torch's sync debug mode raises on the first one.

Run: ``python -m pytest -m gpu tests/gpu/test_vision_metadata_gpu.py``."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_supervised_logits import _setup_batch
from trainer.modeling import vision_metadata as vm
from trainer.sft.forward import LOSS_KEYS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_host_metadata_on_the_gpu_matches_and_the_encoder_never_waits():
    model, batch, _ = _setup_batch("vl", "packed")
    model = model.cuda()
    inputs = {k: v for k, v in batch.items() if k not in LOSS_KEYS}
    on_gpu = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    with torch.no_grad():
        want = model(**on_gpu).logits
    assert vm.install_host_vision_metadata(model)
    encoder = next(m for m in model.modules() if vm.supports_host_metadata(m))
    text = vm.deepstack_owner(model)
    modes, merges = [], []
    strict = encoder.register_forward_pre_hook(lambda *a: [modes.append(torch.cuda.get_sync_debug_mode()),
                                                           torch.cuda.set_sync_debug_mode("error"), None][2])
    relaxed = encoder.register_forward_hook(lambda *a: [torch.cuda.set_sync_debug_mode(modes[-1]), None][1])
    merge = text._deepstack_process

    def strict_merge(*args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            merges.append(1)
            return merge(*args)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    text._deepstack_process = strict_merge
    try:
        with torch.no_grad(), vm.deepstack_positions(text, batch["image_positions"].cuda()):
            got = model(**{**on_gpu, "image_grid_thw": inputs["image_grid_thw"]}).logits
    finally:
        strict.remove()
        relaxed.remove()
        text._deepstack_process = merge
        torch.cuda.set_sync_debug_mode(0)
    assert modes and merges, "the encoder and the deepstack merge ran"
    torch.testing.assert_close(got, want)
