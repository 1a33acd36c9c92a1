"""``training.profile_steps``: the pure summary of a kernel profile, and the trainer profiling exactly the listed
step's forward + backward (on the CPU: operator self times)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.tiny_trainer import tiny_stage2_trainer
from trainer.config.errors import ConfigErrors
from trainer.config.schema import validate_config
from trainer.modeling.fixtures import build_tiny_model
from trainer.profiling import (
    SYNC_WARNING,
    HostSyncTracer,
    KernelTime,
    _ops_with_kernels,
    categorize,
    group_host_syncs,
    host_side,
    host_to_device_sources,
    is_plumbing,
    summarize,
)
from trainer.sft.settings import LayoutSettings, RuntimeSettings
from trainer.sync.policy import SyncDecision, WeightSync
from trainer.sync.weights import full_weights


@pytest.mark.parametrize("name,category", [
    ("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTN", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "attention"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>", "loss"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "elementwise"),
    ("void at::native::multi_tensor_apply_kernel<TensorListMetadata<4>, FusedAdamMathFunctor>", "optimizer"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("void at::native::reduce_kernel<512, 1, ReduceOp<float, func_wrapper_t<float, MeanOps>>>", "reduction"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm"),
    ("aten::mm", "matmul"),
    ("some_unknown_kernel", "other"),
])
def test_categorize_names_the_kernel_family(name, category):
    assert categorize(name) == category


def test_summary_categories_sum_to_busy_time_and_rank_the_top_kernels():
    kernels = [KernelTime("nvjet_gemm_a", 3.0, 100), KernelTime("flash_fwd_kernel", 1.0, 36),
               KernelTime("vectorized_elementwise_kernel", 0.5, 900), KernelTime("Memcpy HtoD", 0.5, 4)]
    s = summarize(kernels, wall_s=10.0, step=2, device="cuda", top_n=2)
    assert s.busy_s == pytest.approx(5.0)
    assert s.busy_fraction == pytest.approx(0.5)
    assert sum(s.by_category_s.values()) == pytest.approx(s.busy_s)
    assert list(s.by_category_s) == ["matmul", "attention", "elementwise", "copy"]
    assert [k["name"] for k in s.top] == ["nvjet_gemm_a", "flash_fwd_kernel"]
    assert s.top[0]["share"] == pytest.approx(0.6)


def test_host_side_counts_kernel_launches_and_the_host_s_own_time():
    """The 2026-11-27 launch-bound 4k row, as the host table listed it: runtime and driver launches count, a copy or
    a synchronize does not; the host's time is every event's self time."""
    events = [("cudaLaunchKernel", 16499, 0.183), ("cuLaunchKernelEx", 6976, 0.087), ("cuLaunchKernel", 6336, 0.077),
              ("cudaMemcpyAsync", 424, 0.011), ("cudaStreamSynchronize", 2, 0.001), ("aten::mm", 6152, 0.274)]
    launches, host_s = host_side(events)
    assert launches == 16499 + 6976 + 6336
    assert host_s == pytest.approx(0.183 + 0.087 + 0.077 + 0.011 + 0.001 + 0.274)
    assert host_side([]) == (0, 0)


def test_host_to_device_copies_are_grouped_by_the_frames_that_issued_them():
    """The 8B sync's 146 pageable copies: which code issues them, from a profile with stacks."""
    load = ["vllm/model_executor/models/qwen3.py(410): load_weights", "trainer/rollout/vllm_compat.py(140): load",
            "trainer/sync/policy.py(88): ensure_fresh"]
    via_torch = [f"{TORCH_DIR}nn/modules/module.py(1773): _call_impl"] + load
    merge = ["trainer/sync/weights.py(330): full_weights", "trainer/sync/policy.py(80): ensure_fresh"]
    ops = [(via_torch, [("Memcpy HtoD (Pageable -> Device)", 2e-5)] * 3),
           (load, [("Memcpy HtoD (Pageable -> Device)", 1e-5), ("Memcpy DtoD (Device -> Device)", 1.0)]),
           (merge, [("Memcpy HtoD (Pinned -> Device)", 5e-4), ("nvjet_gemm", 1.0)]),
           (merge, [("nvjet_gemm", 1.0)])]
    got = host_to_device_sources(ops, frames=2)
    assert got[0] == {"frames": load[:2], "calls": 4, "seconds": pytest.approx(7e-5), "pageable": 4}, \
        "torch's own frames are skipped, so both loader ops are one source; device-to-device copies do not count"
    assert got[1] == {"frames": merge[:2], "calls": 1, "seconds": pytest.approx(5e-4), "pageable": 0}
    assert len(got) == 2 and host_to_device_sources(ops, frames=2, top_n=1) == got[:1]
    assert host_to_device_sources([(merge, [("nvjet_gemm", 1.0)])]) == []


TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def test_only_torch_s_own_package_is_plumbing():
    """The GPU machines install everything under /opt/torch/.venv: a ``/torch/`` substring test dropped transformers'
    and accelerate's frames as if they were torch's (the 2026-11-27 first profile named none of the model's waits)."""
    hf = "/opt/torch/.venv/lib/python3.12/site-packages/transformers/trainer.py:4020 training_step"
    assert not is_plumbing(hf) and not is_plumbing(hf, torch_dir="/opt/torch/.venv/lib/python3.12/site-packages/torch/")
    assert is_plumbing("/opt/torch/.venv/lib/python3.12/site-packages/torch/_tensor.py:1100 tolist",
                       torch_dir="/opt/torch/.venv/lib/python3.12/site-packages/torch/")
    assert is_plumbing(f"{TORCH_DIR}nn/modules/module.py:1773 _call_impl")
    assert is_plumbing("/usr/lib/python3.12/contextlib.py:81 inner") and is_plumbing("<built-in method item>")
    assert group_host_syncs([[f"{TORCH_DIR}_tensor.py:1 item", hf]])[0]["frames"] == [hf]


def test_host_syncs_are_grouped_by_the_frames_that_issued_them():
    vision = ["transformers/models/qwen3_vl/modeling_qwen3_vl.py(700): rot_pos_emb", "trainer/sft/forward.py(46): _f"]
    loss = ["trainer/losses/chunked_objective.py(75): chunked_objective", "trainer/sft/forward.py(47): _f"]
    via_torch = [f"{TORCH_DIR}_tensor.py:1100 tolist"] + vision
    got = group_host_syncs([vision, via_torch, loss, vision], frames=1)
    assert got == [{"frames": vision[:1], "calls": 3}, {"frames": loss[:1], "calls": 1}]
    assert group_host_syncs([vision, loss], top_n=1) == [{"frames": vision, "calls": 1}]
    assert group_host_syncs([]) == []


def _sync_here():
    import warnings
    warnings.warn(f"{SYNC_WARNING} (as torch's sync debug mode warns)", UserWarning, stacklevel=1)


def test_host_sync_tracer_records_each_wait_with_its_caller_and_passes_other_warnings(monkeypatch):
    """The tracer turns torch's sync debug mode on for the region and back off after it; each synchronizing
    operation's warning becomes a stack (not printed), any other warning is shown as before."""
    import warnings

    modes = []
    monkeypatch.setattr("torch.cuda.get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr("torch.cuda.set_sync_debug_mode", modes.append)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with HostSyncTracer(frames=2) as tracer:
            for _ in range(2):
                _sync_here()
            warnings.warn("something else", UserWarning, stacklevel=1)
        _sync_here()  # after the region: an ordinary warning again
    assert modes == ["warn", 0]
    assert [str(w.message) for w in shown] == ["something else", f"{SYNC_WARNING} (as torch's sync debug mode warns)"]
    got = tracer.sources()
    assert len(got) == 1 and got[0]["calls"] == 2
    assert got[0]["frames"][0].endswith("_sync_here") and "test_host_sync_tracer" in got[0]["frames"][1]


def test_profiled_operators_give_their_stack_and_kernel_seconds():
    from torch.autograd.profiler_util import Kernel

    class Event:
        def __init__(self, stack, kernels):
            self.stack, self.kernels = stack, kernels

    class Profile:
        def events(self):
            return [Event(["a.py(1): f"], [Kernel("Memcpy HtoD (Pageable -> Device)", 0, 250.0)]),
                    Event(None, [Kernel("gemm", 0, 1000.0)]), Event(["b.py(2): g"], [])]

    assert _ops_with_kernels(Profile()) == [(["a.py(1): f"], [("Memcpy HtoD (Pageable -> Device)", 2.5e-4)]),
                                            ([], [("gemm", 1e-3)])]


class CopyIntoShadow:
    """A sync target that does a real full sync on the CPU: the product's ``full_weights`` copied into a second
    model's parameters."""

    syncs_on_every_rank = True

    def __init__(self, shadow):
        self.shadow = dict(shadow.state_dict())
        self.synced = 0

    def supports_adapter_sync(self):
        return False

    def begin_sync(self):
        pass

    def end_sync(self):
        pass

    def sync_full(self, model, merge_adapter=True):
        for name, tensor in full_weights(model).items():
            self.shadow[name].copy_(tensor)
        self.synced += 1


def test_the_listed_step_is_profiled_once_and_no_other(tmp_path):
    model, _ = build_tiny_model("text", seed=0)
    target = CopyIntoShadow(build_tiny_model("text", seed=1)[0])
    trainer = tiny_stage2_trainer(tmp_path, model=model, records=6, max_steps=3,
                                  runtime=RuntimeSettings(profile_steps=(2,), profile_trace=True),
                                  weight_sync=WeightSync(target, SyncDecision("full", "test")),
                                  layout=LayoutSettings(micro_batch_rows=1))
    trainer.train()
    assert target.synced == 3
    prof = tmp_path / "out" / "profile"
    assert sorted(p.name for p in prof.iterdir()) == [
        "step2_train.json", "step2_train.trace.json.gz", "step2_train_kernels.txt",
        "step2_weight_sync.json", "step2_weight_sync.trace.json.gz", "step2_weight_sync_kernels.txt"]
    summary = json.loads((prof / "step2_train.json").read_text())
    assert summary["step"] == 2 and summary["region"] == "train" and summary["device"] == "cpu"
    assert summary["rows"] == 2, "the region covers every row of the step (two micro-batches of one target)"
    assert summary["launches"] == 0, "no kernel launches on the CPU"
    assert 0 < summary["host_self_s"], "the host's own operator time is counted"
    attention = [line.split() for line in (prof / "step2_train_kernels.txt").read_text().splitlines()
                 if line.split() and line.split()[0] == "aten::_scaled_dot_product_flash_attention_for_cpu"]
    assert int(attention[0][-1]) == 2 * model.config.num_hidden_layers, "one attention call per layer per row"
    assert summary["wall_s"] > 0 and sum(summary["by_category_s"].values()) == pytest.approx(summary["busy_s"])
    assert summary["by_category_s"].get("matmul", 0) > 0, summary["by_category_s"]
    assert "aten::mm" in (prof / "step2_train_kernels.txt").read_text()
    sync = json.loads((prof / "step2_weight_sync.json").read_text())
    assert sync["region"] == "weight_sync" and sync["by_category_s"].get("copy", 0) > 0, sync
    assert "matmul" not in sync["by_category_s"], "the sync region caught the training forward"
    assert "aten::copy_" in (prof / "step2_weight_sync_kernels.txt").read_text()


def test_profile_steps_are_validated():
    base = {"model": {"tiny": "text"}, "data": {"synthetic": {"num_samples": 4}},
            "training": {"max_steps": 3, "profile_steps": [0, 4]},
            "custom": {"trainer_variant": "rollout_matching_sft",
                       "extra": {"rollout_matching": {"rollout_backend": "hf"}}}}
    with pytest.raises(ConfigErrors, match=r"training\.profile_steps.*\[0, 4\]"):
        validate_config(base)
    assert validate_config({**base, "training": {"max_steps": 3, "profile_steps": [1, 3]}}).training.profile_steps \
        == [1, 3]
    with pytest.raises(ConfigErrors, match=r"training\.profile_trace"):
        validate_config({**base, "training": {"max_steps": 3, "profile_trace": True}})


def _norm_weights_to_device(weights):

    return [w.to("meta") for w in weights]


def test_host_to_device_tracer_names_the_caller_of_each_host_to_device_op():
    """The dispatcher sees every aten op that reads a host tensor into a device result (``meta`` stands in for
    ``cuda`` on this CPU machine); ops that stay on one side are not counted."""
    import torch

    from trainer.profiling import HostToDeviceTracer

    weights = [torch.ones(4) for _ in range(5)]
    with HostToDeviceTracer(device_type="meta", frames=2) as tracer:
        _norm_weights_to_device(weights)
        torch.ones(3, device="meta") * 2  # device only
        torch.ones(3) + 1  # host only
    (group,) = tracer.sources()
    assert group["calls"] == 5 and group["host_bytes"] == 5 * 4 * 4, group
    assert "_to_copy" in group["op"] and any("_norm_weights_to_device" in f for f in group["frames"]), group
    assert tracer._mode is None, "the mode is popped on exit"
    with HostToDeviceTracer(device_type="meta") as quiet:
        torch.ones(2) * 3
    assert quiet.sources() == []
