"""``vllm.sync.merge_into_engine`` (the colocate 8B sync): ``InProcessVllm.load_unmerged`` writes each LoRA
layer's merge GEMM straight into the parameters of an engine that holds no valid weights (level 2 asleep), through
the recorded load, then checks what it wrote; otherwise it merges on the learner's side and loads as before. The
fake engine below is a module with a real recorded load (``trainer.rollout.load_plan``) behind vLLM's calls; the
merge is the real ``trainer.sync.weights.LoraProduct``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trainer.config.vllm import VllmConfig, VllmSyncConfig
from trainer.rollout import vllm_compat, vllm_inprocess
from trainer.rollout.load_plan import record_load
from trainer.rollout.vllm_inprocess import InProcessVllm, VllmSettings
from trainer.sync.update_check import TensorSpec, WeightUpdateRefused
from trainer.sync.weights import LoraProduct, UnmergedWeights


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(12, 8), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(8), requires_grad=False)


def _load(model: _Model, tensors: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, w in tensors.items():
            if name == "norm.weight":
                model.norm.data.copy_(w)
            else:
                model.qkv.data.narrow(0, {"q.weight": 0, "k.weight": 4, "v.weight": 8}[name], 4).copy_(w)


SPEC = {"q.weight": TensorSpec((4, 8), torch.float32), "k.weight": TensorSpec((4, 8), torch.float32),
        "v.weight": TensorSpec((4, 8), torch.float32), "norm.weight": TensorSpec((8,), torch.float32)}


class _LLM:
    """vLLM's in-process calls over ``_Model``: the worker holds the load ``record_load`` recorded."""

    def __init__(self, events: list[str]):
        self.events = events
        self.model = _Model()
        self.worker = SimpleNamespace(model_runner=SimpleNamespace())

    def record(self, tensors):
        self.worker._rm_load_plan = record_load(lambda: _load(self.model, tensors), tensors,
                                                list(self.model.parameters()))

    def wake_up(self, tags):
        self.events.append(f"wake:{','.join(tags)}")

    def collective_rpc(self, fn, args=()):
        if fn is vllm_inprocess._load_in_worker:
            self.events.append("load merged tensors")
            _load(self.model, args[0])
            return [len(args[0])]
        if fn is vllm_inprocess._merge_in_worker:
            self.events.append("merge into engine")
        return [fn(self.worker, *args)]


@pytest.fixture
def events(monkeypatch) -> list[str]:
    monkeypatch.setattr(vllm_compat, "engine_in_process", lambda: True)
    return []


def _engine(events: list[str], *, merge_into_engine: bool = True, weights_valid: bool = False) -> InProcessVllm:
    engine = object.__new__(InProcessVllm)
    engine.settings = VllmSettings(model_dir="unused", max_model_len=64, sleep_level=2, recorded_load=True,
                                   merge_into_engine=merge_into_engine)
    engine.llm = _LLM(events)
    engine.dtype = torch.float32
    engine._spec = SPEC
    engine._asleep = {"weights", "kv_cache"}
    engine._weights_valid = weights_valid
    engine._caches_stale = False
    engine._waking = None
    engine._merge_refused = None
    engine.last_load = None
    return engine


def _update(seed: int, nan: bool = False) -> UnmergedWeights:
    gen = torch.Generator().manual_seed(seed)
    base = {n: torch.randn(*s.shape, generator=gen) for n, s in SPEC.items()}
    b = torch.randn(4, 2, generator=gen)
    if nan:
        b[1, 0] = float("nan")
    products = {"q.weight": LoraProduct(b, torch.randn(2, 8, generator=gen), 0.5),
                "v.weight": LoraProduct(torch.randn(4, 2, generator=gen), torch.randn(2, 8, generator=gen), 2.0)}
    return UnmergedWeights(base, products)


def _expected(update: UnmergedWeights) -> dict[str, torch.Tensor]:
    model = _Model()
    _load(model, update.merged())
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_the_products_are_written_into_the_woken_engine_and_give_the_merged_weights(events):
    engine = _engine(events)
    engine.llm.record(_update(0).merged())
    update = _update(1)
    report = engine.load_unmerged(update)
    assert events == ["wake:weights", "merge into engine"], "the layout checked on the host, then wake, then write"
    for name, want in _expected(update).items():
        assert torch.equal(dict(engine.llm.model.named_parameters())[name], want), name
    assert engine._weights_valid and engine._caches_stale and report.tensors == 4
    assert engine.llm.worker._rm_load_path == "merged"


def test_a_non_finite_merge_is_refused_after_the_write_and_leaves_no_valid_weights(events):
    engine = _engine(events)
    engine.llm.record(_update(0).merged())
    with pytest.raises(WeightUpdateRefused, match=r"'q.weight': non-finite values \(8 NaN.*after the LoRA merge into "
                                                  r"it; the engine holds no valid weights"):
        engine.load_unmerged(_update(1, nan=True))
    assert not engine._weights_valid, "the next decode reloads from the learner (weights_source)"
    engine.load_unmerged(_update(2))
    assert engine._weights_valid, "a good update after the refusal serves"


def test_a_wrong_layout_is_refused_before_the_wake(events):
    engine = _engine(events)
    engine.llm.record(_update(0).merged())
    update = _update(1)
    update.base["norm.weight"] = torch.zeros(8, 2)
    with pytest.raises(WeightUpdateRefused):
        engine.load_unmerged(update)
    assert events == []


@pytest.mark.parametrize("case, reason", [
    ("first sync", "no load recorded yet"),
    ("valid weights", "the engine holds valid weights"),
    ("off", "merge_into_engine is off"),
    ("other shapes", "shape, stride, dtype or device differs"),
])
def test_otherwise_the_update_is_merged_on_the_learners_side_and_loaded_as_before(events, case, reason, caplog):
    engine = _engine(events, merge_into_engine=case != "off", weights_valid=case == "valid weights")
    if case != "first sync":
        engine.llm.record(_update(0).merged())
    update = _update(1)
    if case == "other shapes":
        engine._spec = {**SPEC, "norm.weight": TensorSpec((8,), torch.float64)}
        update.base["norm.weight"] = update.base["norm.weight"].double()
        engine.settings = VllmSettings(**{**vars(engine.settings), "allow_dtype_cast": True})
    assert reason in engine.merge_refusal(update)
    with caplog.at_level("INFO", logger=vllm_inprocess.__name__):
        engine.load_unmerged(update)
    assert "merge into engine" not in events and "load merged tensors" in events
    if case != "off":
        assert reason in caplog.text, "the reason is logged (once per reason)"
    if case != "other shapes":
        for name, want in _expected(update).items():
            assert torch.equal(dict(engine.llm.model.named_parameters())[name], want), name


def test_merge_into_engine_is_a_sync_setting_for_a_level_2_colocated_engine_with_the_recorded_load():
    assert VllmSyncConfig().merge_into_engine is False
    with pytest.raises(ValueError, match="set sync.recorded_load: true"):
        VllmSyncConfig(merge_into_engine=True)
    with pytest.raises(ValueError, match="merge_into_engine checks .*overlap_wake checks"):
        VllmSyncConfig(merge_into_engine=True, recorded_load=True, overlap_wake=True)
    sync = {"merge_into_engine": True, "recorded_load": True}
    with pytest.raises(ValueError, match="needs mode: colocate and sleep_level: 2 .*sleep_level: kv_cache"):
        VllmConfig(sleep_level="kv_cache", sync=sync)
    with pytest.raises(ValueError, match="got mode: server"):
        VllmConfig(mode="server", sleep_level=2, sync=sync)
    assert VllmConfig(sleep_level=2, sync=sync).sync.merge_into_engine


def test_the_colocate_sync_hands_the_engine_the_unmerged_update(monkeypatch):
    from trainer.rollout import vllm_colocate

    seen = []
    vllm = SimpleNamespace(settings=SimpleNamespace(merge_into_engine=True, overlap_wake=False),
                           load_unmerged=lambda u: seen.append(u) or vllm_inprocess.LoadReport(1, 4, 0.0, 0.0),
                           drop_adapter=lambda: None)
    engine = object.__new__(vllm_colocate.VllmColocateEngine)
    engine.vllm, engine.merge_precision = vllm, "weight_dtype"
    sentinel = UnmergedWeights({}, {})
    monkeypatch.setattr(vllm_colocate, "unmerged_weights", lambda model, merge_precision: sentinel)
    engine.sync_full(torch.nn.Linear(2, 2))
    assert seen == [sentinel] and callable(vllm.weights_source), "the decode's reload keeps the merged source"
