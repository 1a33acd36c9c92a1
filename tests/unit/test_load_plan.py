"""``trainer.rollout.load_plan``: a loader shaped like vLLM's (stacked qkv shards, a padded vocabulary with zeroed
rows, a plain copy) recorded once and replayed for a new update gives exactly what the loader gives; a loader that
computes with the values, or copies anywhere but a parameter, is refused after its load completed; an update or
parameters unlike the recording are not replayed."""

from __future__ import annotations

import pytest
import torch

from trainer.rollout.load_plan import LoadRefused, record_load


class _Engine(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(12, 8, dtype=dtype), requires_grad=False)
        self.o = torch.nn.Parameter(torch.zeros(8, 8, dtype=dtype), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(8, dtype=dtype), requires_grad=False)
        self.embed = torch.nn.Parameter(torch.full((10, 8), 5.0, dtype=dtype), requires_grad=False)


def vllm_like_load(engine: _Engine, tensors: dict[str, torch.Tensor]) -> None:
    """Stacked shards by offset, a padded embedding (copy the rows, zero the rest), plain copies."""
    with torch.no_grad():
        for name, w in tensors.items():
            if name in ("q", "k", "v"):
                shard = {"q": 0, "k": 4, "v": 8}[name]
                engine.qkv.data.narrow(0, shard, 4).copy_(w)
            elif name == "embed":
                engine.embed.data[: w.shape[0]].copy_(w)
                engine.embed.data[w.shape[0]:].fill_(0)
            else:
                getattr(engine, name).data.copy_(w)


def _update(seed: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (4, 8), "k": (4, 8), "v": (4, 8), "o": (8, 8), "norm": (8,), "embed": (9, 8)}
    return {n: torch.randn(*s, generator=g).to(dtype) for n, s in shapes.items()}


def _params(engine: _Engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.named_parameters()}


def test_a_recorded_load_replays_a_new_update_exactly_as_the_loader_loads_it():
    engine = _Engine()
    first = _update(0)
    plan = record_load(lambda: vllm_like_load(engine, first), first, list(engine.parameters()))
    assert len(plan.copies) == 6
    recorded = _params(engine)
    reference = _Engine()
    vllm_like_load(reference, first)
    assert all(torch.equal(recorded[n], v) for n, v in _params(reference).items()), "recording ran the load"

    second = _update(1)
    assert plan.mismatch(second) is None
    assert plan.replay(second) == 6
    vllm_like_load(reference, second)
    for name, want in _params(reference).items():
        assert torch.equal(dict(engine.named_parameters())[name], want), name
    assert not engine.embed[9].any(), "the zeroed padding row stays as the recorded load left it"


def test_inputs_that_are_views_of_one_stacked_tensor_are_told_apart():
    engine = _Engine()
    stacked = torch.randn(3, 4, 8)
    first = {"q": stacked[0], "k": stacked[1], "v": stacked[2]}
    plan = record_load(lambda: vllm_like_load(engine, first), first, list(engine.parameters()))
    again = torch.randn(3, 4, 8)
    second = {"q": again[0], "k": again[1], "v": again[2]}
    assert plan.mismatch(second) is None
    plan.replay(second)
    assert torch.equal(engine.qkv.data, again.reshape(12, 8))
    separate = {n: t.clone() for n, t in second.items()}
    assert "share storage differently" in plan.mismatch(separate)


def test_a_cast_into_the_parameter_dtype_is_replayed_with_the_cast():
    engine = _Engine(torch.float32)
    first, second = _update(0, torch.bfloat16), _update(1, torch.bfloat16)
    plan = record_load(lambda: vllm_like_load(engine, first), first, list(engine.parameters()))
    plan.replay(second)
    assert torch.equal(engine.o.data, second["o"].float())


@pytest.mark.parametrize("loader, reason", [
    (lambda e, t: e.o.data.copy_(t["o"] * 2), "aten.mul.Tensor reads o"),
    (lambda e, t: torch.empty(8, 8).copy_(t["o"]), "not a parameter"),
    (lambda e, t: (e.o.data.copy_(t["o"]), e.norm.data.add_(1.0)), "writes a parameter outside a copy"),
    (lambda e, t: None, "copied nothing"),
    (lambda e, t: (e.o.data.copy_(t["o"]), setattr(e.norm, "data", t["norm"])), "new storage"),
])
def test_a_loader_that_does_more_than_copy_is_refused_after_its_load_completed(loader, reason):
    engine = _Engine()
    update = {"o": torch.randn(8, 8), "norm": torch.randn(8)}
    with pytest.raises(LoadRefused, match=reason):
        record_load(lambda: loader(engine, update), update, list(engine.parameters()))
    if "mul" in reason:
        assert torch.equal(engine.o.data, update["o"] * 2), "the load itself ran"


def test_an_update_or_engine_unlike_the_recording_is_not_replayed():
    engine = _Engine()
    first = _update(0)
    plan = record_load(lambda: vllm_like_load(engine, first), first, list(engine.parameters()))
    assert "names differ" in plan.mismatch({k: v for k, v in first.items() if k != "o"})
    assert "names differ" in plan.mismatch(dict(reversed(list(first.items()))))
    assert "o: shape" in plan.mismatch({**first, "o": torch.randn(8, 8).t()})
    assert "o: shape" in plan.mismatch({**first, "o": torch.randn(8, 8, dtype=torch.float64)})
    engine.o.data = torch.zeros(8, 8)
    assert "parameters moved" in plan.mismatch(_update(1))


def test_names_of_one_tensor_a_tied_lm_head_record_and_replay_while_they_stay_tied():
    engine = _Engine()
    embed = torch.randn(9, 8)
    first = {"embed": embed, "lm_head": embed, "o": torch.randn(8, 8)}

    def load():
        vllm_like_load(engine, {"embed": first["embed"], "o": first["o"]})

    plan = record_load(load, first, list(engine.parameters()))
    tied = torch.randn(9, 8)
    assert plan.mismatch({"embed": tied, "lm_head": tied, "o": torch.randn(8, 8)}) is None
    plan.replay({"embed": tied, "lm_head": tied, "o": torch.randn(8, 8)})
    assert torch.equal(engine.embed.data[:9], tied)
    untied = {"embed": tied, "lm_head": tied.clone(), "o": torch.randn(8, 8)}
    assert "share storage differently" in plan.mismatch(untied)


@pytest.mark.parametrize("refused", [False, True])
def test_the_recorded_update_is_freed_when_the_caller_drops_it_without_a_collection(refused):
    """2026-11-27 (8B, H200): the step that recorded the load held 11.5 GiB more through its decode and training than
    every later step — the update, kept alive by the recorder's reference cycle until Python's collector ran."""
    import gc
    import weakref

    engine = _Engine()
    held = {"update": _update(0)}
    watched = weakref.ref(held["update"]["o"])

    def load():
        vllm_like_load(engine, held["update"])
        if refused:
            _ = held["update"]["o"] * 2  # arithmetic on the update: refused

    gc.disable()
    try:
        if refused:
            with pytest.raises(LoadRefused):
                record_load(load, held["update"], list(engine.parameters()))
        else:
            assert len(record_load(load, held["update"], list(engine.parameters())).copies) == 6
        held.clear()
        assert watched() is None, "the update outlived record_load"
    finally:
        gc.enable()


class _Product:
    """``trainer.sync.weights.LoraProduct``'s contract (``add_to``), counting how it was run."""

    def __init__(self, b: torch.Tensor, a: torch.Tensor, scaling: float):
        self.b, self.a, self.scaling = b, a, scaling
        self.into: list[torch.Tensor] = []
        self.made = 0

    def add_to(self, weight, out=None):
        if out is None:
            self.made += 1
            return torch.addmm(weight, self.b, self.a, alpha=self.scaling)
        self.into.append(out)
        return torch.addmm(weight, self.b, self.a, alpha=self.scaling, out=out)


def narrowed_o_load(engine: _Engine, tensors: dict[str, torch.Tensor]) -> None:
    """``vllm_like_load`` with ``o`` given twice as many rows as the engine keeps (a tensor-parallel shard)."""
    vllm_like_load(engine, {n: t for n, t in tensors.items() if n != "o"})
    with torch.no_grad():
        engine.o.data.copy_(tensors["o"].narrow(0, 0, 8))


def test_a_replay_into_the_engine_writes_each_product_where_the_merged_tensor_would_have_gone():
    shapes = {"q": (4, 8), "k": (4, 8), "v": (4, 8), "o": (16, 8), "norm": (8,), "embed": (9, 8)}
    gen = torch.Generator().manual_seed(3)

    def update() -> dict[str, torch.Tensor]:
        return {n: torch.randn(*s, generator=gen) for n, s in shapes.items()}

    engine = _Engine()
    first = update()
    plan = record_load(lambda: narrowed_o_load(engine, first), first, list(engine.parameters()))
    base = update()
    products = {n: _Product(torch.randn(base[n].shape[0], 2, generator=gen), torch.randn(2, 8, generator=gen), 0.5)
                for n in ("q", "v", "o")}
    merged = {n: (products[n].add_to(t) if n in products else t) for n, t in base.items()}
    for p in products.values():
        p.made = 0
    assert plan.mismatch(base) is None

    written = plan.replay_into(base, products)
    reference = _Engine()
    narrowed_o_load(reference, merged)
    for name, want in _params(reference).items():
        assert torch.equal(dict(engine.named_parameters())[name], want), name
    assert [n for n, _ in written] == [c.name for c in plan.copies]
    assert all(dst.data_ptr() == c.dst.data_ptr() for (_, dst), c in zip(written, plan.copies))
    assert products["q"].made == 0 and products["v"].made == 0, "whole copies write the engine, no merged tensor"
    assert [t.data_ptr() for t in products["q"].into] == [engine.qkv.data[0:4].data_ptr()]
    assert products["o"].made == 1 and not products["o"].into, "a copy of part of a tensor reads its merge, made once"
