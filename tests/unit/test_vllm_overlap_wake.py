"""``vllm.sync.overlap_wake`` (the colocate 8B sync): ``InProcessVllm.load_weights`` checks the update's
names, shapes and dtypes, launches its finite check, wakes the weights while the device reduces, and reads the check
before anything is written. The fake engine below records the order of vLLM's wake, the check's read and the load;
the check itself is the real ``trainer.sync.update_check`` code."""

from __future__ import annotations

import pytest
import torch

from trainer.config.vllm import VllmSyncConfig
from trainer.rollout import vllm_compat, vllm_inprocess
from trainer.rollout.vllm_inprocess import InProcessVllm, VllmSettings
from trainer.sync import update_check
from trainer.sync.update_check import TensorSpec, WeightUpdateRefused


class _LLM:
    def __init__(self, events: list[str]):
        self.events = events

    def wake_up(self, tags):
        self.events.append(f"wake:{','.join(tags)}")

    def collective_rpc(self, fn, args=()):
        if fn is vllm_inprocess._load_in_worker:
            self.events.append(f"load:{','.join(sorted(args[0]))}")
        return [None]


@pytest.fixture
def events(monkeypatch) -> list[str]:
    seen: list[str] = []
    read = update_check.FiniteFlags.first_bad

    def first_bad(self):
        seen.append("check read")
        return read(self)

    monkeypatch.setattr(update_check.FiniteFlags, "first_bad", first_bad)
    monkeypatch.setattr(vllm_compat, "engine_in_process", lambda: True)
    return seen


def _engine(events: list[str], overlap: bool) -> InProcessVllm:
    engine = object.__new__(InProcessVllm)
    engine.settings = VllmSettings(model_dir="unused", max_model_len=64, sleep_level=2, overlap_wake=overlap)
    engine.llm = _LLM(events)
    engine.dtype = torch.float32
    engine._spec = {"a.weight": TensorSpec((2, 3), torch.float32), "b.weight": TensorSpec((4,), torch.float32)}
    engine._asleep = {"weights", "kv_cache"}
    engine._weights_valid = False
    engine._caches_stale = False
    engine._waking = None
    engine.last_load = None
    return engine


def _update(bad: bool = False) -> dict[str, torch.Tensor]:
    b = torch.ones(4)
    if bad:
        b[2] = float("nan")
    return {"a.weight": torch.zeros(2, 3), "b.weight": b}


@pytest.mark.parametrize("overlap, order", [
    (False, ["check read", "wake:weights", "load:a.weight,b.weight"]),
    (True, ["wake:weights", "check read", "load:a.weight,b.weight"]),
])
def test_the_check_is_read_before_the_load_and_after_the_wake_only_with_overlap(events, overlap, order):
    engine = _engine(events, overlap)
    report = engine.load_weights(_update())
    assert events == order
    assert engine._weights_valid and engine._asleep == {"kv_cache"}, "only the weights woke"
    assert report.tensors == 2 and report.check_s >= 0


@pytest.mark.parametrize("overlap", [False, True])
def test_a_non_finite_update_writes_nothing_and_leaves_no_valid_weights(events, overlap):
    engine = _engine(events, overlap)
    with pytest.raises(WeightUpdateRefused, match="'b.weight'.*1 NaN.*; the engine holds no valid weights"):
        engine.load_weights(_update(bad=True))
    assert not any(e.startswith("load") for e in events), "nothing written before the check was read"
    assert not engine._weights_valid, "level 2's weights stay invalid: the next decode reloads from the learner"
    assert ("wake:weights" in events) == overlap, "without overlap a refused update wakes nothing"


def test_an_engine_with_valid_weights_says_the_old_ones_keep_serving(events):
    engine = _engine(events, False)
    engine._weights_valid = True
    with pytest.raises(WeightUpdateRefused, match="1 NaN.*; the old weights keep serving$"):
        engine.load_weights(_update(bad=True))


def test_a_wrong_layout_is_refused_before_the_wake_even_with_overlap(events):
    engine = _engine(events, True)
    with pytest.raises(WeightUpdateRefused, match=r"'a.weight': shape \[3, 2\]"):
        engine.load_weights({"a.weight": torch.zeros(3, 2), "b.weight": torch.ones(4)})
    assert events == [], "a shape mismatch is known on the host: no wake, no device read"


def test_start_check_update_checks_the_layout_at_once_and_the_values_at_wait():
    spec = {"w": TensorSpec((2,), torch.float32)}
    with pytest.raises(WeightUpdateRefused, match="'x': not a weight"):
        update_check.start_check_update({"x": torch.tensor([float("nan")])}, spec)
    pending = update_check.start_check_update({"w": torch.tensor([1.0, float("inf")])}, spec)
    with pytest.raises(WeightUpdateRefused, match="'w': non-finite values \\(0 NaN, 1 inf"):
        pending.wait()
    update_check.start_check_update({"w": torch.tensor([1.0, 2.0])}, spec).wait()
    update_check.start_check_update({"w": torch.tensor([1.0, float("nan")])}, spec, check_finite=False).wait()


def test_overlap_wake_is_a_sync_setting_that_reaches_the_engine_and_refuses_prewake(monkeypatch):
    from types import SimpleNamespace

    from trainer.config.schema import validate_config
    from trainer.rollout import vllm_colocate

    assert VllmSyncConfig().overlap_wake is False
    with pytest.raises(ValueError, match="sync.overlap_wake and sync.prewake"):
        VllmSyncConfig(overlap_wake=True, prewake=True)
    built: list[VllmSettings] = []

    class _Recorder:
        def __init__(self, settings):
            built.append(settings)

    monkeypatch.setattr(vllm_colocate, "InProcessVllm", _Recorder)
    cfg = validate_config({"model": {"path": "unused"}, "data": {"synthetic": {"num_samples": 2}}, "custom": {"extra": {"rollout_matching": {
        "rollout_backend": "vllm", "vllm": {"mode": "colocate", "max_model_len": 1024,
                                            "sync": {"overlap_wake": True}}}}}})
    model = torch.nn.Linear(2, 2)
    loaded = SimpleNamespace(model_dir="unused", tokenizer=SimpleNamespace())
    monkeypatch.setattr("trainer.modeling.coord_vocab.stop_token_ids", lambda tok: [0])
    vllm_colocate.engine_from_config(cfg.custom.extra.rollout_matching, loaded, model)
    assert built[-1].overlap_wake is True
