"""Offload context: state leaves the accelerator inside the block and returns intact, also on exceptions."""

from __future__ import annotations

import pytest
import torch

from trainer.memory.offload import OffloadUnsupportedError, offload_for_rollout


def _setup():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8, device=device)).sum().backward()
    opt.step()
    return model, opt, device


def test_round_trip_restores_values_and_devices():
    model, opt, device = _setup()
    before = [p.detach().clone() for p in model.parameters()]
    exp_avg = [s["exp_avg"].clone() for s in opt.state.values()]
    with offload_for_rollout(model, opt) as stats:
        assert all(p.device.type == "cpu" for p in model.parameters())
        assert all(s["exp_avg"].device.type == "cpu" for s in opt.state.values())
    assert all(p.device.type == device for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(exp_avg, opt.state.values()))
    if device == "cuda":
        assert stats.moved_param_bytes > 0 and stats.moved_optimizer_bytes > 0
    opt.step()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device moves need CUDA; CPU run checks restore only")
def test_restored_after_exception_on_gpu():
    model, opt, _ = _setup()
    with pytest.raises(RuntimeError, match="decode failed"):
        with offload_for_rollout(model, opt):
            raise RuntimeError("decode failed")
    assert all(p.device.type == "cuda" for p in model.parameters())


def test_restored_after_exception():
    model, opt, device = _setup()
    with pytest.raises(RuntimeError, match="decode failed"):
        with offload_for_rollout(model, opt, offload_optimizer=False):
            raise RuntimeError("decode failed")
    assert all(p.device.type == device for p in model.parameters())


def test_zero3_partitioned_parameters_are_refused():
    model = torch.nn.Linear(2, 2)
    model.weight.ds_id = 7
    with pytest.raises(OffloadUnsupportedError, match="ZeRO-3"):
        with offload_for_rollout(model, None):
            pass


def test_simulated_device_moves_copy_and_restore(monkeypatch):
    """CPU-only hosts: with simulated moves every tensor really leaves its storage, so the restore is exercised."""
    from trainer.memory import offload

    monkeypatch.setattr(offload, "_SIMULATE_DEVICE_MOVES", True)
    model, opt, _ = _setup()
    before = [p.detach().clone() for p in model.parameters()]
    ptrs = [p.data_ptr() for p in model.parameters()]
    state_ptrs = [s["exp_avg"].data_ptr() for s in opt.state.values()]
    with pytest.raises(RuntimeError, match="decode failed"):
        with offload_for_rollout(model, opt) as stats:
            assert all(p.data_ptr() != q for p, q in zip(model.parameters(), ptrs))
            assert all(s["exp_avg"].data_ptr() != q for s, q in zip(opt.state.values(), state_ptrs))
            raise RuntimeError("decode failed")
    assert stats.moved_param_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert stats.moved_optimizer_bytes > 0 and stats.backend == "torch"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.step()


def test_zero_optimizer_with_bare_module_is_refused():
    from trainer.memory.offload import check_offloadable

    DeepSpeedZeroOptimizer = type("DeepSpeedZeroOptimizer", (), {"__module__": "deepspeed.runtime.zero.stage_1_and_2"})
    wrapper = type("DeepSpeedOptimizerWrapper", (), {})()
    wrapper.optimizer = DeepSpeedZeroOptimizer()
    with pytest.raises(OffloadUnsupportedError, match="model_wrapped"):
        check_offloadable(torch.nn.Linear(2, 2), wrapper)
    check_offloadable(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
