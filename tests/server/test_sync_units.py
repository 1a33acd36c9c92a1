"""Weight-sync building blocks: sync-mode resolution, ms-swift-layout flat buckets, and the exported weights
(merged LoRA equals peft's own merge; the training model is left untouched)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.sync.buckets import FlatTensorMeta, flatten, plan_buckets, unflatten
from trainer.sync.policy import SyncModeError, resolve_sync_mode
from trainer.sync.weights import adapter_kind, adapter_weights, full_weights, write_adapter_dir


@pytest.mark.parametrize("requested, adapter, serves, fallback, want", [
    ("full", "lora", True, False, "full"),
    ("auto", "lora", True, False, "adapter"),
    ("auto", "lora", False, False, "full"),
    ("auto", None, True, False, "full"),
    ("auto", "dora", True, False, "full"),
    ("adapter", "lora", True, False, "adapter"),
    ("adapter", "lora", False, True, "full"),
    ("adapter", "dora", True, True, "full"),
])
def test_resolve_sync_mode(requested, adapter, serves, fallback, want):
    assert resolve_sync_mode(requested, adapter, serves, fallback).mode == want


@pytest.mark.parametrize("adapter, serves, match", [
    (None, True, "needs a LoRA model"),
    ("lora", False, "does not serve LoRA adapters"),
    ("dora", True, "cannot serve DoRA"),
])
def test_resolve_sync_mode_errors_name_the_key(adapter, serves, match):
    with pytest.raises(SyncModeError, match=match) as info:
        resolve_sync_mode("adapter", adapter, serves, fallback_to_full=False)
    assert "vllm.sync.mode" in str(info.value)


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 5), min_size=0, max_size=3)),
                min_size=1, max_size=6))
def test_flatten_roundtrip(specs):
    named = []
    for i, (dtype, shape) in enumerate(specs):
        numel = 1
        for s in shape:
            numel *= s
        named.append((f"t{i}", (torch.arange(numel) % 7 + i).to(dtype).reshape(shape)))
    metas, bucket = flatten(named)
    assert bucket.dtype == torch.uint8 and bucket.numel() == metas[-1].end_idx
    back = unflatten([FlatTensorMeta.model_validate(m.model_dump()) for m in metas], bucket)
    for name, t in named:
        assert back[name].dtype == t.dtype and torch.equal(back[name], t)
    unaligned = [m.model_copy(update={"start_idx": m.start_idx + 1, "end_idx": m.end_idx + 1}) for m in metas]
    shifted = unflatten(unaligned, torch.cat([torch.zeros(1, dtype=torch.uint8), bucket]))
    for name, t in named:
        assert torch.equal(shifted[name], t), "senders that do not align (ms-swift) must still decode"


def test_bucket_plan_respects_the_limit():
    named = {f"w{i}": torch.zeros(n, dtype=torch.float32) for i, n in enumerate([10, 10, 30, 5, 5])}
    plan = list(plan_buckets(named, max_bytes=80))
    assert plan == [["w0", "w1"], ["w2"], ["w3", "w4"]]
    assert [n for b in plan for n in b] == list(named)


@pytest.fixture(scope="module")
def tiny(tiny_text_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_text_dir, dtype=torch.float32)


def test_full_weights_names_and_tied_head(tiny):
    w = full_weights(tiny)
    assert set(tiny.state_dict()) <= set(w) and "lm_head.weight" in w
    assert torch.equal(w["lm_head.weight"], w["model.embed_tokens.weight"])


def test_merged_lora_equals_peft_merge_and_model_is_untouched(tiny, tmp_path):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(copy.deepcopy(tiny), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                               init_lora_weights=False))
    assert adapter_kind(peft_model) == "lora" and adapter_kind(tiny) is None
    before = {k: v.clone() for k, v in peft_model.state_dict().items()}
    merged = full_weights(peft_model)
    base = full_weights(peft_model, merge_adapter=False)
    assert all(torch.equal(before[k], v) for k, v in peft_model.state_dict().items())
    reference = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    assert set(merged) == set(reference) | {"lm_head.weight"}
    for k, v in reference.items():
        torch.testing.assert_close(merged[k], v, rtol=0, atol=1e-6)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], base[q]) and torch.equal(base[q], tiny.state_dict()[q])

    ad = adapter_weights(peft_model)
    peft_model.save_pretrained(tmp_path / "ref")
    from safetensors.torch import load_file

    assert set(ad.tensors) == set(load_file(tmp_path / "ref" / "adapter_model.safetensors"))
    d = write_adapter_dir(tmp_path / "ours", ad)
    assert json.loads((d / "adapter_config.json").read_text())["r"] == 4
    from peft import PeftModel

    reloaded = PeftModel.from_pretrained(copy.deepcopy(tiny), d)
    x = torch.tensor([[5, 6, 7]])
    torch.testing.assert_close(reloaded(x).logits, peft_model(x).logits)


def test_dora_full_sync_uses_peft_merge(tiny):
    from peft import LoraConfig, get_peft_model

    dora = get_peft_model(copy.deepcopy(tiny), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True,
                                                          init_lora_weights=False))
    assert adapter_kind(dora) == "dora"
    before = {k: v.clone() for k, v in dora.state_dict().items()}
    merged = full_weights(dora)
    reference = copy.deepcopy(dora).merge_and_unload().state_dict()
    for k, v in reference.items():
        torch.testing.assert_close(merged[k], v, rtol=0, atol=1e-6)
    for k, v in dora.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=1e-6)


def _bf16_lora(tiny, b_scale: float = 1.0):
    """A bf16 model with float32 LoRA factors (peft's default) that use float32's precision, as optimizer steps
    leave them (peft initializes them in the base's dtype: bf16 values in float32 tensors)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(tiny).to(torch.bfloat16),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(1 + 0.01 * torch.randn(p.shape, generator=gen)).mul_(b_scale if "lora_B" in name else 1.0)
    return model


def _lora_parts(model) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]:
    """checkpoint weight name -> (base weight, B, A, scaling) of every plain LoRA layer"""
    from peft.tuners.lora import LoraLayer

    return {n.removeprefix("base_model.model.") + ".weight": (m.get_base_layer().weight, m.lora_B["default"].weight,
                                                              m.lora_A["default"].weight, m.scaling["default"])
            for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def test_merged_lora_of_a_bf16_model_with_fp32_adapters_rounds_once_like_peft(tiny):
    peft_model = _bf16_lora(tiny)
    q = "model.layers.0.self_attn.q_proj"
    assert peft_model.get_submodule(f"base_model.model.{q}").lora_A["default"].weight.dtype == torch.float32
    merged = full_weights(peft_model, merge_precision="float32")
    reference = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    assert merged[f"{q}.weight"].dtype == torch.bfloat16
    for k, v in reference.items():  # equal up to one bf16 rounding step (GEMM summation order)
        torch.testing.assert_close(merged[k], v, rtol=2**-7, atol=1e-6)
    mismatched = sum(int((merged[k] != v).sum()) for k, v in reference.items())
    assert mismatched <= 0.001 * sum(v.numel() for v in reference.values()), mismatched


def test_merge_in_the_weight_dtype_is_one_gemm_onto_the_weight_with_factors_rounded_to_it(tiny):
    peft_model = _bf16_lora(tiny)
    merged = full_weights(peft_model)
    assert all(torch.equal(v, merged[k]) for k, v in full_weights(peft_model, merge_precision="weight_dtype").items())
    exact = full_weights(peft_model, merge_precision="float32")
    parts = _lora_parts(peft_model)
    assert len(parts) > 10
    total = mismatched = 0
    for key, (w, b, a, scaling) in parts.items():
        # what it computes: W + s * bf16(B) @ bf16(A), exactly, rounded once to bf16 (GEMM summation order aside)
        want = (w.double() + scaling * (b.bfloat16().double() @ a.bfloat16().double())).to(torch.bfloat16)
        mismatched += int((merged[key] != want).sum())
        total += want.numel()
        # and from the float32 merge by one rounding step of the result plus what rounding the factors moves
        bound = 2**-6 * (w.double().abs() + scaling * (b.double().abs() @ a.double().abs())) + 1e-12
        assert bool(((merged[key].double() - exact[key].double()).abs() <= bound).all()), key
    assert mismatched <= 0.001 * total, (mismatched, total)
    assert sum(int((merged[k] != exact[k]).sum()) for k in parts) > 0, "the float32 and weight-dtype merges were equal"
    for key in set(merged) - set(parts):  # unadapted weights are passed through untouched
        assert torch.equal(merged[key], exact[key])


def test_merge_precisions_differ_in_few_elements_for_adapter_updates_smaller_than_the_weights(tiny):
    """B scaled so that the LoRA update is ~1 % of the weight, as in fine-tuning: the two merges then disagree in a
    few percent of elements, by one rounding step."""
    peft_model = _bf16_lora(tiny, b_scale=0.01)
    parts = _lora_parts(peft_model)
    with torch.no_grad():
        ratio = sum(float((s * (b @ a)).abs().mean() / w.float().abs().mean())
                    for w, b, a, s in parts.values()) / len(parts)
    assert 0.001 < ratio < 0.05, ratio
    fast, exact = full_weights(peft_model), full_weights(peft_model, merge_precision="float32")
    differ = sum(int((fast[k] != exact[k]).sum()) for k in parts) / sum(fast[k].numel() for k in parts)
    print(f"update / weight {ratio:.4f}; elements where the merges differ: {differ:.4f}")
    assert 0 < differ < 0.05, differ


def test_unknown_merge_precision_is_refused(tiny):
    with pytest.raises(ValueError, match="merge precision 'fp8'"):
        full_weights(_bf16_lora(tiny), merge_precision="fp8")


def test_batched_float32_merge_in_chunks_matches_the_per_layer_merge(tiny, monkeypatch):
    from trainer.sync import weights

    peft_model = _bf16_lora(tiny)
    whole = full_weights(peft_model, merge_precision="float32")
    q = next(k for k in whole if k.endswith("q_proj.weight"))
    monkeypatch.setattr(weights, "MERGE_CHUNK_ELEMENTS", 2 * whole[q].numel())  # chunks of 2 q_proj, single others
    chunked = full_weights(peft_model, merge_precision="float32")
    reference = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    for k, v in reference.items():
        torch.testing.assert_close(chunked[k], whole[k], rtol=2**-7, atol=1e-6)
        torch.testing.assert_close(chunked[k], v, rtol=2**-7, atol=1e-6)
    assert all(v.is_contiguous() for v in chunked.values())


def test_the_cached_weight_layout_follows_new_adapters_and_replaced_parameters(tiny):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(copy.deepcopy(tiny), LoraConfig(r=4, target_modules=["q_proj"],
                                                               init_lora_weights=False))
    q, v = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight"
    first = full_weights(peft_model)
    assert not torch.equal(first[q], tiny.state_dict()[q]) and torch.equal(first[v], tiny.state_dict()[v])

    peft_model.add_adapter("second", LoraConfig(r=4, target_modules=["v_proj"], init_lora_weights=False))
    peft_model.set_adapter("second")
    second = full_weights(peft_model)
    assert torch.equal(second[q], tiny.state_dict()[q]), "the inactive adapter was merged"
    assert not torch.equal(second[v], tiny.state_dict()[v]), "the new adapter's layers were not merged"
    reference = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    torch.testing.assert_close(second[v], reference[v], rtol=0, atol=1e-6)

    plain = copy.deepcopy(tiny)
    full_weights(plain)
    norm = "model.norm.weight"
    plain.model.norm.weight = torch.nn.Parameter(torch.full_like(plain.model.norm.weight, 3.0))
    assert torch.equal(full_weights(plain)[norm], torch.full_like(plain.model.norm.weight, 3.0))
    with torch.no_grad():
        plain.model.norm.weight.mul_(2)
    assert torch.equal(full_weights(plain)[norm], torch.full_like(plain.model.norm.weight, 6.0))


def test_the_cached_weight_layout_does_not_keep_a_model_alive(tiny):
    import gc
    import weakref

    from peft import LoraConfig, get_peft_model

    for make in (lambda: copy.deepcopy(tiny),
                 lambda: get_peft_model(copy.deepcopy(tiny), LoraConfig(r=4, target_modules=["q_proj"]))):
        model = make()
        full_weights(model)
        ref = weakref.ref(model)
        del model
        gc.collect()
        assert ref() is None, "the weight-layout cache keeps the model alive"


def test_a_module_replaced_by_one_of_the_same_kind_is_read_after_the_replacement(tiny):
    """Same module count, same adapters: only the registration tells the cached layout is stale."""
    plain = copy.deepcopy(tiny)
    key = "model.layers.0.mlp.down_proj.weight"
    full_weights(plain)
    old = plain.model.layers[0].mlp.down_proj
    new = torch.nn.Linear(old.in_features, old.out_features, bias=False)
    with torch.no_grad():
        new.weight.fill_(0.5)
    plain.model.layers[0].mlp.down_proj = new
    assert torch.equal(full_weights(plain)[key], torch.full_like(old.weight, 0.5))


def test_the_module_tree_is_walked_again_only_after_a_registration(tiny, monkeypatch):
    from peft import LoraConfig, get_peft_model

    from trainer.sync import weights

    peft_model = get_peft_model(copy.deepcopy(tiny), LoraConfig(r=4, target_modules=["q_proj"],
                                                               init_lora_weights=False))
    first = full_weights(peft_model)
    walks = []
    real = weights._still_valid
    monkeypatch.setattr(weights, "_still_valid", lambda plan, model: walks.append(1) or real(plan, model))
    q = "model.layers.0.self_attn.q_proj.weight"
    with torch.no_grad():
        peft_model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight.mul_(2)
    second = full_weights(peft_model)
    assert walks == [], "an unchanged model's tree was walked again"
    assert not torch.equal(first[q], second[q]), "the new LoRA values were not merged"
    torch.nn.Sequential().add_module("elsewhere", torch.nn.Identity())  # any registration in the process
    full_weights(peft_model)
    assert walks == [1]
    full_weights(peft_model)
    assert walks == [1], "the walk's verdict is kept until the next registration"


def test_unmerged_weights_leave_each_plain_lora_product_to_add_and_merge_to_full_weights_bit_for_bit(tiny):
    from trainer.sync.weights import unmerged_weights

    peft_model = _bf16_lora(tiny)
    update = unmerged_weights(peft_model)
    merged = full_weights(peft_model)
    assert list(update.base) == list(merged), "the same keys, in the same order (a recorded load checks the order)"
    parts = _lora_parts(peft_model)
    assert set(update.products) == set(parts)
    for key, (w, *_rest) in parts.items():
        assert update.base[key].data_ptr() == w.data_ptr(), f"{key}: the frozen weight itself, no copy"
        assert update.base[key].shape == merged[key].shape and update.base[key].dtype == merged[key].dtype
        out = torch.empty_like(merged[key])
        update.products[key].add_to(update.base[key], out=out)
        assert torch.equal(out, merged[key]), f"{key}: the product written into a given output is the merge"
    again = update.merged()
    assert all(torch.equal(again[k], v) for k, v in merged.items())
    exact = unmerged_weights(peft_model, merge_precision="float32")
    assert not exact.products, "the float32 merge is made here, in its arithmetic"
    assert all(torch.equal(exact.base[k], v) for k, v in full_weights(peft_model, merge_precision="float32").items())
    cast = unmerged_weights(peft_model, dtype=torch.float32)
    assert not cast.products and all(v.dtype == torch.float32 for v in cast.base.values() if v.is_floating_point())
