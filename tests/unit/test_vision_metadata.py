"""``training.host_vision_metadata``: the Qwen3-VL vision encoder's metadata made on the host from the image grid
equals what the encoder derives itself, the hooked encoder uses it (and its outputs do not change), and a grid already
on the device, a text model or another family are left alone; the deepstack merge by the collator's image positions
equals the merge by mask, without boolean-mask indexing."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_supervised_logits import _setup_batch
from trainer.modeling import vision_metadata as vm
from trainer.modeling.fixtures import build_tiny_model
from trainer.sft.forward import LOSS_KEYS


def _encoder(model):
    return next(m for m in model.modules() if vm.supports_host_metadata(m))


def test_metadata_of_a_known_grid():
    """Two images of 4x6 and 2x2 patches (merge 2): two attention segments of 24 and 4 patches, the patches' (h, w)
    rotary ids in merge-block order, and four interpolation taps per patch."""
    model, _ = build_tiny_model("vl", seed=0)
    enc = _encoder(model)
    meta = vm.vision_metadata(enc, torch.tensor([[1, 4, 6], [1, 2, 2]]))
    assert meta.cu_seqlens.tolist() == [0, 24, 28] and meta.cu_seqlens.dtype == torch.int32
    assert meta.max_seqlen == 24
    assert meta.position_ids.shape == (28, 2)
    assert meta.position_ids[:4].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]], "the first 2x2 merge block"
    assert meta.position_ids[4:8].tolist() == [[0, 2], [0, 3], [1, 2], [1, 3]], "the block to its right"
    assert meta.interp_indices.shape == meta.interp_weights.shape == (28, 4)
    assert torch.allclose(meta.interp_weights.sum(-1), torch.ones(28))
    with pytest.raises(ValueError, match="host"):
        vm.vision_metadata(enc, torch.empty(0, 3, device="meta"))


def test_the_hooked_encoder_uses_the_host_metadata_and_its_outputs_do_not_change(monkeypatch):
    model, batch, _ = _setup_batch("vl", "packed")
    inputs = {k: v for k, v in batch.items() if k not in LOSS_KEYS}
    assert inputs["image_grid_thw"].shape[0] >= 2, "a row of several images"
    with torch.no_grad():
        plain = model(**inputs).logits
    assert vm.install_host_vision_metadata(model) and vm.install_host_vision_metadata(model)
    assert len(_encoder(model)._forward_pre_hooks) == 1, "installed once"
    made, seen = [], []
    real = vm.vision_metadata
    monkeypatch.setattr(vm, "vision_metadata", lambda enc, grid: made.append(real(enc, grid)) or made[-1])
    block = type(_encoder(model).blocks[0])
    forward = block.forward
    monkeypatch.setattr(block, "forward", lambda self, *a, **k: seen.append(k["cu_seqlens"]) or forward(self, *a, **k))
    with torch.no_grad():
        hooked = model(**inputs).logits
    assert len(made) == 1
    assert seen and all(cu is made[0].cu_seqlens for cu in seen), "every vision layer read the host boundaries"
    assert torch.equal(hooked, plain)


def test_a_grid_on_the_device_a_text_model_and_precomputed_kwargs_pass_through(monkeypatch):
    model, _ = build_tiny_model("vl", seed=0)
    enc = _encoder(model)
    calls = []
    monkeypatch.setattr(vm, "vision_metadata", lambda *a: calls.append(a))
    pixels = torch.zeros(4, 8)
    assert vm._pre_hook(enc, (pixels,), {"grid_thw": torch.tensor([[1, 2, 2]], device="meta")}) is None
    assert vm._pre_hook(enc, (pixels,), {"grid_thw": torch.tensor([[1, 2, 2]]), "cu_seqlens": torch.tensor([0, 4])}) \
        is None
    assert calls == []
    text, _ = build_tiny_model("text", seed=0)
    assert vm.install_host_vision_metadata(text) is False


def test_encoder_kwargs_keep_the_boundaries_on_the_host_unless_the_attention_is_flash():
    model, _ = build_tiny_model("vl", seed=0)
    meta = vm.vision_metadata(_encoder(model), torch.tensor([[1, 2, 2]]))
    plain = vm.encoder_kwargs(meta, torch.device("cpu"), flash=False)
    assert plain["cu_seqlens"] is meta.cu_seqlens and plain["max_seqlen"] == 4
    assert set(plain) == {"cu_seqlens", "max_seqlen", "position_ids", "interp_indices", "interp_weights"}


@pytest.mark.parametrize("on", [True, False])
def test_training_makes_the_metadata_on_the_host_only_when_configured(tmp_path, monkeypatch, on):
    """A tiny Qwen3-VL stage-2 run with packing: the trainer keeps ``image_grid_thw`` on the host and every packed
    forward's encoder takes the host metadata; ``host_vision_metadata: false`` leaves the encoder to derive it."""
    import trainer.sft.trainer as trainer_module
    from tests.integration.test_train_tiny import config
    from trainer.config.schema import validate_config
    from trainer.sft.run import run_training

    made, merged = [], []
    real = vm.vision_metadata
    monkeypatch.setattr(vm, "vision_metadata", lambda enc, grid: made.append(torch.is_grad_enabled()) or real(enc, grid))
    positions = trainer_module.deepstack_positions
    monkeypatch.setattr(trainer_module, "deepstack_positions",
                        lambda owner, pos: merged.append(owner is not None and pos is not None) or positions(owner, pos))
    raw = config(tmp_path, "vl", max_steps=2, packing=True, packing_length=4096, host_vision_metadata=on)
    raw["data"]["synthetic"]["num_samples"] = 16
    run_training(validate_config(raw))
    assert (made.count(True) >= 2) if on else (made == []), "training forwards (grad on) took the host metadata"
    assert merged and all(m is on for m in merged), "each row's deepstack merge got the host positions iff on"


class _DataDependentOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the operators whose result depends on tensor values the host must read (on a GPU, each is a wait for
    it): scalar reads, ``nonzero``, tensor-count ``repeat_interleave``, boolean-mask indexing. ``.tolist()`` on a host
    tensor dispatches nothing, so on the CPU this is a lower bound."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        aten = torch.ops.aten
        name = None
        if func in (aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default):
            name = str(func)
        elif func is aten.repeat_interleave.Tensor and (kwargs or {}).get("output_size") is None:
            name = str(func)
        elif func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or [])):
            name = f"{func} (boolean mask)"
        if name:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def test_the_hooked_encoder_body_reads_nothing_back():
    """Inside the vision encoder's forward (the hook's own host work excluded), the grid's derivations issue
    data-dependent operators without the host metadata and none with it."""
    model, batch, _ = _setup_batch("vl", "packed")
    inputs = {k: v for k, v in batch.items() if k not in LOSS_KEYS}
    enc = _encoder(model)
    counted = {}

    def run(key):
        mode = _DataDependentOps()
        enter = enc.register_forward_pre_hook(lambda *a: [mode.__enter__(), None][1])
        leave = enc.register_forward_hook(lambda *a: [mode.__exit__(None, None, None), None][1])
        try:
            with torch.no_grad():
                model(**inputs)
        finally:
            enter.remove()
            leave.remove()
        counted[key] = mode.ops

    run("device derivation")
    vm.install_host_vision_metadata(model)  # registered before the counting hooks below, so it runs first
    run("host metadata")
    assert counted["device derivation"], counted
    assert counted["host metadata"] == [], counted


def _loss_grads(model, inputs, positions=None):
    model.zero_grad(set_to_none=True)
    with _DataDependentOps() as mode, vm.deepstack_positions(vm.deepstack_owner(model), positions):
        logits = model(**inputs).logits
        logits.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads, [op for op in mode.ops if "boolean mask" in op]


def test_the_deepstack_merge_by_host_positions_equals_the_merge_by_mask():
    """The collator's ``image_positions`` are the image tokens a boolean mask selects; with them the wrapped deepstack
    merge gives the same logits and gradients with no boolean-mask indexing in the forward or the backward, and
    positions that do not match the features fall back to the model's own merge."""
    model, batch, _ = _setup_batch("vl", "packed")
    inputs = {k: v for k, v in batch.items() if k not in LOSS_KEYS}
    image_token_id = model.config.image_token_id
    assert torch.equal(batch["image_positions"], torch.stack(torch.nonzero(batch["input_ids"] == image_token_id,
                                                                           as_tuple=True)))
    want_logits, want_grads, masked = _loss_grads(model, inputs)
    assert masked, "the model's own merge indexes by a boolean mask"
    vm.install_host_vision_metadata(model)
    logits, grads, masked = _loss_grads(model, inputs, batch["image_positions"])
    assert masked == []
    torch.testing.assert_close(logits, want_logits)
    assert grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, msg=name)
    _, _, masked = _loss_grads(model, inputs, batch["image_positions"][:, 1:])
    assert masked, "positions of another count: the model's own merge"
