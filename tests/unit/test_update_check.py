"""``trainer.sync.update_check``: the weight-update check every receiver runs before any served weight changes, the
checkpoint spec read from safetensors headers, and the learner's non-finite check before a push."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from safetensors.torch import save_file

from trainer.sync.update_check import (
    NonFiniteWeightsError,
    TensorSpec,
    WeightUpdateRefused,
    check_learner_weights,
    check_update,
    first_non_finite,
    spec_from_checkpoint,
    spec_from_state_dict,
)

SPEC = {"a.weight": TensorSpec((4, 3), torch.float32), "b.weight": TensorSpec((5,), torch.float32),
        "steps": TensorSpec((), torch.int64)}


def good() -> dict[str, torch.Tensor]:
    return {"a.weight": torch.randn(4, 3), "b.weight": torch.randn(5), "steps": torch.tensor(3)}


def refused(tensors, spec=SPEC, **kwargs) -> WeightUpdateRefused:
    with pytest.raises(WeightUpdateRefused) as info:
        check_update(tensors, spec, **kwargs)
    return info.value


def test_a_good_update_passes_and_the_message_format_is_fixed():
    check_update(good(), SPEC)
    check_update({"b.weight": torch.zeros(5)}, SPEC)  # a partial update is fine unless require_all
    err = WeightUpdateRefused("x", "shape [1] != served [2]")
    assert str(err) == "weight update refused: tensor 'x': shape [1] != served [2]; the old weights keep serving"
    assert str(WeightUpdateRefused(None, "empty")) == "weight update refused: empty; the old weights keep serving"
    back = pickle.loads(pickle.dumps(err))
    assert (back.tensor, back.reason, str(back)) == ("x", err.reason, str(err))
    assert isinstance(err, ValueError)


def test_unknown_names_first_one_named():
    t = {**good(), "z.weight": torch.zeros(1), "y.weight": torch.zeros(1)}
    err = refused(t)
    assert err.tensor == "z.weight" and "not a weight of the served model" in err.reason and "1 more" in err.reason


def test_wrong_shape():
    t = good()
    t["b.weight"] = torch.zeros(6)
    err = refused(t)
    assert err.tensor == "b.weight" and err.reason == "shape [6] != served [5]"


def test_non_floating_dtype_for_a_floating_weight_is_refused_even_when_casting_is_allowed():
    t = good()
    t["a.weight"] = torch.ones(4, 3, dtype=torch.int32)
    for allow in (False, True):
        err = refused(t, allow_cast=allow)
        assert err.tensor == "a.weight" and "torch.int32 is not a floating dtype" in err.reason
    t["a.weight"] = torch.ones(4, 3, dtype=torch.bool)
    assert refused(t, allow_cast=True).tensor == "a.weight"


def test_other_floating_dtype_only_with_allow_cast():
    t = good()
    t["a.weight"] = torch.randn(4, 3).to(torch.bfloat16)
    err = refused(t)
    assert err.tensor == "a.weight" and "torch.bfloat16 != served torch.float32" in err.reason
    assert "--allow-dtype-cast" in err.reason
    check_update(t, SPEC, allow_cast=True)
    t = good()
    t["steps"] = torch.tensor(3, dtype=torch.int32)  # a non-floating served tensor needs its exact dtype
    assert refused(t, allow_cast=True).tensor == "steps"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values(bad):
    t = good()
    t["b.weight"][2] = bad
    err = refused(t)
    assert err.tensor == "b.weight" and "non-finite" in err.reason
    assert ("1 NaN" in err.reason) == (bad != bad)
    check_update(t, SPEC, check_finite=False)
    t["a.weight"][0, 0] = float("nan")
    assert refused(t).tensor == "a.weight", "the first bad tensor in payload order"


def test_missing_names_only_with_require_all():
    t = good()
    del t["b.weight"]
    check_update(t, SPEC)
    err = refused(t, require_all=True)
    assert err.tensor == "b.weight" and "missing" in err.reason


def test_check_order_unknown_shape_dtype_missing_finite():
    nan = torch.full((4, 3), float("nan"))
    assert refused({"a.weight": nan, "q": torch.zeros(1)}, require_all=True).tensor == "q"
    assert "shape" in refused({"a.weight": nan[:2].int(), "b.weight": torch.zeros(5).int()}).reason
    assert "dtype" in refused({"a.weight": nan, "b.weight": torch.zeros(5).int()}, require_all=True).reason
    assert "missing" in refused({"a.weight": nan}, require_all=True).reason
    assert "non-finite" in refused({"a.weight": nan}).reason


def test_first_non_finite():
    assert first_non_finite({}) is None
    ok = {"i": torch.arange(3), "e": torch.empty(0), "f": torch.ones(2, dtype=torch.bfloat16)}
    assert first_non_finite(ok) is None
    bad = {**ok, "x": torch.tensor([1.0, float("inf")]), "y": torch.tensor([float("nan")], dtype=torch.float16)}
    assert first_non_finite(bad) == "x"
    assert first_non_finite({"y": bad["y"], "x": bad["x"]}) == "y"


def test_one_device_sync_for_all_tensors(monkeypatch):
    """The per-tensor flags are stacked and read once (not one ``bool()``/``item()`` per tensor)."""
    reads = []
    real_stack = torch.stack

    def counting_stack(tensors, *a, **k):
        reads.append(len(tensors))
        return real_stack(tensors, *a, **k)

    monkeypatch.setattr(torch, "stack", counting_stack)
    assert first_non_finite({f"t{i}": torch.ones(3) for i in range(50)}) is None
    assert reads == [50]


def test_spec_from_state_dict_and_checkpoint_agree(tiny_text_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_text_dir)
    from_model = spec_from_state_dict(model.state_dict())
    from_ckpt = spec_from_checkpoint(tiny_text_dir)
    assert "lm_head.weight" in from_ckpt, "tied embeddings: lm_head added with the embedding's spec"
    assert from_ckpt == from_model
    served = spec_from_checkpoint(tiny_text_dir, dtype=torch.bfloat16)
    assert {s.dtype for s in served.values()} == {torch.bfloat16}
    assert {n: s.shape for n, s in served.items()} == {n: s.shape for n, s in from_ckpt.items()}


def test_spec_from_a_sharded_checkpoint_reads_only_headers(tmp_path):
    save_file({"model.embed_tokens.weight": torch.zeros(10, 4)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"model.norm.weight": torch.zeros(4, dtype=torch.bfloat16), "model.pos": torch.zeros(3, dtype=torch.int64)},
              str(tmp_path / "model-00002-of-00002.safetensors"))
    save_file({"stray": torch.zeros(1)}, str(tmp_path / "not-in-index.safetensors"))  # the index decides
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "model.norm.weight": "model-00002-of-00002.safetensors", "model.pos": "model-00002-of-00002.safetensors"}}))
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    spec = spec_from_checkpoint(tmp_path, dtype=torch.float16)
    assert spec == {"model.embed_tokens.weight": TensorSpec((10, 4), torch.float16),
                    "model.norm.weight": TensorSpec((4,), torch.float16),
                    "model.pos": TensorSpec((3,), torch.int64)}
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"tie_word_embeddings": True}}))
    assert spec_from_checkpoint(tmp_path)["lm_head.weight"] == TensorSpec((10, 4), torch.float32)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        spec_from_checkpoint(tmp_path / "missing")


def test_learner_check_names_the_parameter_and_the_step():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    check_learner_weights(model, 5)
    with torch.no_grad():
        model[1].bias[1] = float("nan")
    with pytest.raises(NonFiniteWeightsError) as info:
        check_learner_weights(model, 7, last_synced_step=6)
    err = info.value
    assert (err.tensor, err.step) == ("1.bias", 7)
    text = str(err)
    assert "'1.bias'" in text and "optimizer step 7" in text and "rollout servers keep the last good weights" in text
    assert "synced at step 6" in text and "checkpoint" in text
    with_ckpt = err.with_checkpoint("/run/stage2/checkpoint-4")
    assert "the last checkpoint is /run/stage2/checkpoint-4" in str(with_ckpt)
    assert "none (no checkpoint" in str(err.with_checkpoint(None))
    assert str(pickle.loads(pickle.dumps(with_ckpt))) == str(with_ckpt)


def test_first_non_finite_mixed_dtypes_huge_finite_values_and_mapping_order():
    from trainer.sync.update_check import first_non_finite

    huge = torch.full((64,), 3.0e38)  # sums/norms of these overflow; max-abs does not
    tensors = {"a": huge.to(torch.bfloat16), "b": huge, "c": torch.ones(3, dtype=torch.float16),
               "i": torch.arange(4), "empty": torch.empty(0)}
    assert first_non_finite(tensors) is None
    tensors["d"] = torch.tensor([0.0, float("-inf")], dtype=torch.float16)
    tensors["e"] = torch.tensor([float("nan")])
    assert first_non_finite(tensors) == "d"
    assert first_non_finite({"e": tensors["e"], "d": tensors["d"]}) == "e"


def test_learner_check_reads_frozen_parameters_until_found_finite_and_again_when_they_change(monkeypatch):
    from trainer.sync import update_check

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    model[0].requires_grad_(False)  # a frozen base (vision tower, LoRA base weights)
    read: list[set[str]] = []
    real = update_check.first_non_finite
    monkeypatch.setattr(update_check, "first_non_finite", lambda t: read.append(set(t)) or real(t))
    check_learner_weights(model, 1)
    check_learner_weights(model, 2)
    assert read == [{"0.weight", "0.bias", "1.weight", "1.bias"}, {"1.weight", "1.bias"}], read

    with torch.no_grad():  # written in place (its version counter moves): read again, and the NaN is found
        model[0].bias[0] = float("nan")
    with pytest.raises(NonFiniteWeightsError) as info:
        check_learner_weights(model, 3)
    assert info.value.tensor == "0.bias"
    with pytest.raises(NonFiniteWeightsError):  # a failed check remembers nothing: still refused
        check_learner_weights(model, 4)

    with torch.no_grad():
        model[0].bias.zero_()
    check_learner_weights(model, 5)
    model[0].weight = torch.nn.Parameter(torch.full((3, 3), float("inf")), requires_grad=False)  # replaced
    with pytest.raises(NonFiniteWeightsError) as info:
        check_learner_weights(model, 6)
    assert info.value.tensor == "0.weight"

    other = torch.nn.Sequential(torch.nn.Linear(3, 3))  # the memory is per model
    other.requires_grad_(False)
    read.clear()
    check_learner_weights(other, 1)
    assert read == [{"0.weight", "0.bias"}]


def test_a_frozen_parameter_unfrozen_later_is_read_at_every_call(monkeypatch):
    from trainer.sync import update_check

    model = torch.nn.Linear(3, 3).requires_grad_(False)
    check_learner_weights(model, 1)
    model.weight.requires_grad_(True)
    read: list[set[str]] = []
    real = update_check.first_non_finite
    monkeypatch.setattr(update_check, "first_non_finite", lambda t: read.append(set(t)) or real(t))
    check_learner_weights(model, 2)
    check_learner_weights(model, 3)
    assert read == [{"weight"}, {"weight"}]
