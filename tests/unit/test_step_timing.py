"""``time/*_s`` of one stage-2 step: weight_sync, rollout, target, forward and backward are disjoint and add up to
``time/step_s`` (``backward`` used to subtract ``target``, already inside ``rollout``, and never
``weight_sync``). Each outer phase is made slow by a known amount, so a phase that leaks into another shows.

The slow phases do not sleep: they advance the clock the step's timers read (``time.perf_counter`` in
``trainer.telemetry`` and ``trainer.sft.trainer``) by their amount, so the amounts can dwarf any real time a loaded
machine takes, and the checks are exact."""

from __future__ import annotations

import time

import pytest
from transformers import TrainingArguments

from trainer import telemetry
from trainer.data.records import load_jsonl
from trainer.data.synthetic import generate
from trainer.modeling.coord_vocab import stop_token_ids
from trainer.modeling.fixtures import build_tiny_model, tiny_tokenizer
from trainer.modeling.prompts import PromptEncoder
from trainer.rollout.hf import HFRolloutEngine
from trainer.rollout.types import DecodingParams
from trainer.sft import trainer as trainer_module
from trainer.sft.settings import RolloutSettings, TrainerSettings
from trainer.sft.stage2 import Stage2Pipeline
from trainer.sft.trainer import STEP_PHASES, RolloutMatchingTrainer, SampleDataset

SYNC_S, GENERATE_S, TARGET_S, ENCODE_S = 400.0, 300.0, 1500.0, 70.0  # virtual seconds


class VirtualTime:
    """``time`` for the timers: ``perf_counter`` is the real one plus the seconds the slow phases added."""

    def __init__(self):
        self.added = 0.0

    def perf_counter(self) -> float:
        return time.perf_counter() + self.added

    def spend(self, seconds: float) -> None:
        self.added += seconds

    def __getattr__(self, name):
        return getattr(time, name)


CLOCK = VirtualTime()


class SlowEngine:
    def __init__(self, engine):
        self.engine = engine

    def generate(self, requests, params):
        CLOCK.spend(GENERATE_S)
        return self.engine.generate(requests, params)

    def close(self):
        self.engine.close()


class SlowPipeline(Stage2Pipeline):
    def requests(self, *args, **kwargs):
        CLOCK.spend(ENCODE_S)
        return super().requests(*args, **kwargs)

    def targets(self, *args, **kwargs):
        CLOCK.spend(TARGET_S)
        return super().targets(*args, **kwargs)


class SlowSync:
    def ensure_fresh(self, model, step):
        CLOCK.spend(SYNC_S)
        return True


def test_step_phases_are_disjoint_and_sum_to_the_step(tmp_path, monkeypatch):
    monkeypatch.setattr(telemetry, "time", CLOCK)
    monkeypatch.setattr(trainer_module, "time", CLOCK)
    tok = tiny_tokenizer()
    model, _ = build_tiny_model("text", seed=0)
    samples = load_jsonl(generate(tmp_path / "data", 2, seed=0, max_objects=2))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=2,
                             learning_rate=1e-5, logging_steps=1, save_strategy="no", report_to=[],
                             remove_unused_columns=False, disable_tqdm=True, use_cpu=True)
    engine = SlowEngine(HFRolloutEngine(model, tok.pad_token_id, sorted(stop_token_ids(tok)), 2))
    trainer = RolloutMatchingTrainer(model=model, args=args, train_dataset=SampleDataset(samples),
                                     pipeline=SlowPipeline(PromptEncoder(tok)), engine=engine,
                                     settings=TrainerSettings(rollout=RolloutSettings(DecodingParams(max_new_tokens=8))),
                                     weight_sync=SlowSync(), processing_class=tok)
    trainer.train()
    logged = next(r for r in trainer.state.log_history if "time/step_s" in r)
    t = {p: logged[f"time/{p}_s"] for p in STEP_PHASES}
    # disjoint and complete: with weight_sync counted in backward too, or target subtracted twice, this fails
    assert sum(t.values()) == pytest.approx(logged["time/step_s"], rel=1e-6), t
    assert t["weight_sync"] >= SYNC_S and t["target"] >= TARGET_S and t["rollout"] >= GENERATE_S
    assert logged["time/generate_s"] >= GENERATE_S and logged["time/generate_s"] <= t["rollout"]
    assert t["rollout"] - logged["time/generate_s"] < TARGET_S, "the target phase is not inside rollout"
    # encoding (chat template + image processor) is its own sub-phase of rollout, apart from generate
    assert ENCODE_S <= logged["time/encode_s"] < ENCODE_S + GENERATE_S
    assert logged["time/encode_s"] + logged["time/generate_s"] <= t["rollout"]
    assert logged["time/generate_s"] < GENERATE_S + ENCODE_S, "encoding counted inside generate"
    assert t["weight_sync"] < SYNC_S + GENERATE_S and t["target"] < TARGET_S + SYNC_S, "a phase leaked into another"
    assert t["backward"] > 0
    assert logged["time/parse_s"] + logged["time/match_s"] + logged["time/build_target_s"] <= t["target"]
    assert logged["gc/pause_s"] >= 0 and logged["gc/collections"] >= logged["gc/gen2_collections"] >= 0
    assert trainer.gc_clock._on_gc not in __import__("gc").callbacks, "the callback is removed when train returns"


def test_the_gc_clock_counts_pauses_between_open_and_close():
    import gc

    clock = telemetry.GcClock()
    gc.collect()
    assert clock.pop()["gc/collections"] == 0, "not counting before open"
    clock.open()
    clock.open()  # idempotent: one callback
    junk = []
    for _ in range(2000):
        a, b = [], []
        a.append(b)
        b.append(a)
        junk.append(a)
    del junk
    gc.collect()
    got = clock.pop()
    assert got["gc/collections"] >= 1 and got["gc/gen2_collections"] >= 1 and got["gc/pause_s"] > 0
    assert clock.pop() == {"gc/pause_s": 0.0, "gc/collections": 0.0, "gc/gen2_collections": 0.0}
    clock.close()
    gc.collect()
    assert clock.pop()["gc/collections"] == 0
