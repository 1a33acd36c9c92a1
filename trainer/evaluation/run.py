"""Held-out evaluation at the edge: load the split, decode greedily through the configured rollout engine, parse
with the training parser, score with ``trainer.evaluation.metrics`` and write the files.

Used three ways: ``python -m trainer eval`` (``cli.py``), the periodic eval during stage 2
(``PeriodicEvalCallback``: before the first stage-2 step — i.e. after the stage-1 warm-up —, every
``training.eval_steps`` and after the last step) and the demo's before/after table.

Files per evaluation (``write_eval``): ``metrics.json`` (every number), ``metrics.md`` (headline table) and
``samples.jsonl`` (one row per sample: prediction, GT, matches, FP/FN indices, parse errors, response text).
Held-out records that ``data.on_bad_record: drop`` left out of the split are counted in ``metrics.json``
(``dropped_records``, ``dropped``: id and reason of each) and in ``metrics.md``: the numbers are of the rest.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from trainer.data.records import LoadReport, Sample, load_jsonl
from trainer.data.synthetic import generate, scene_style
from trainer.evaluation.metrics import (
    DEFAULT_RESOLUTION,
    DetectionMetrics,
    SampleEval,
    SamplePrediction,
    evaluate_samples,
    markdown_table,
    sample_record,
)
from trainer.rollout.codec import RolloutCodec
from trainer.rollout.types import DecodingParams, RolloutResult, check_prompt_alignment
from trainer.telemetry import JsonlWriter

log = logging.getLogger(__name__)
EVAL_PREFIX = "eval/"
SHOWN_DROPPED = 10


class EvalSetupError(ValueError):
    """No eval split, or a checkpoint that cannot be found; the message says what to set."""


@dataclass(frozen=True)
class DroppedRecord:
    """A held-out record left out of the split: its id (``None`` when the line has none) and why
    (``file:line: reason``)."""

    sample_id: str | None
    reason: str

    def to_json(self) -> dict[str, str | None]:
        return {"id": self.sample_id, "reason": self.reason}


@dataclass(frozen=True)
class EvalSplit(Sequence):
    """The held-out samples scored, and the records ``data.on_bad_record: drop`` left out (reported with every
    evaluation of the split)."""

    samples: tuple[Sample, ...]
    dropped: tuple[DroppedRecord, ...] = ()

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i):  # type: ignore[override]
        return self.samples[i]

    def __iter__(self) -> Iterator[Sample]:
        return iter(self.samples)


def load_split(path: str | Path, image_root: str | Path | None = None, on_bad_record: str = "error") -> EvalSplit:
    """``load_jsonl`` of a held-out file, keeping what it dropped (id and reason of each)."""
    report = LoadReport()
    samples = load_jsonl(path, image_root, on_bad_record=on_bad_record, report=report)
    return EvalSplit(tuple(samples), tuple(DroppedRecord(i, r) for i, r in zip(report.dropped_ids, report.dropped)))


def load_eval_samples(cfg: Any, split: str | None = None) -> EvalSplit:
    """``split`` (a JSONL file) if given, else ``data.eval_jsonl``, else the held-out synthetic split
    (``data.synthetic.eval_num_samples`` samples from ``eval_seed``, default ``seed + 1``)."""
    d = cfg.data
    if split or d.eval_jsonl:
        return load_split(split or d.eval_jsonl, d.image_root, d.on_bad_record)
    s = d.synthetic
    if s is not None and s.eval_num_samples:
        seed = s.eval_seed if s.eval_seed is not None else s.seed + 1
        path = generate(Path(cfg.training.output_dir) / "data-eval", s.eval_num_samples, seed, s.min_objects,
                        s.max_objects, s.image_size, s.poly_fraction, filename="eval.jsonl", style=scene_style(s))
        return load_split(path)
    raise EvalSetupError("no eval split: pass --split FILE.jsonl, or set data.eval_jsonl, or (synthetic data) "
                         "data.synthetic.eval_num_samples")


def greedy(decoding: DecodingParams) -> DecodingParams:
    """The training decoding limits, greedy (evaluation never samples)."""
    return DecodingParams(decoding.max_new_tokens, 0.0, 1.0, -1, decoding.repetition_penalty, None)


def predictions(pipeline: RolloutCodec, samples: Sequence[Sample], results: Sequence[RolloutResult]) -> list[SamplePrediction]:
    """Strict parse of each rollout (the training parser) → ``SamplePrediction`` beside its GT."""
    out = []
    for sample, res in zip(samples, results):
        parsed = pipeline.parse(res)
        failure = "broken" if parsed.broken else ("unclosed" if parsed.truncated else None)
        text = pipeline.tokenizer.decode(list(res.response_token_ids), skip_special_tokens=False)
        out.append(SamplePrediction(sample.sample_id, tuple(sample.objects), tuple(o.to_det() for o in parsed.objects),
                                    dict(parsed.invalid), failure, bool(res.truncated),
                                    len(res.response_token_ids), text))
    return out


@dataclass(frozen=True)
class EvalResult:
    """One evaluation; ``dropped``: the held-out records left out of the split (the metrics are of the rest)."""

    metrics: DetectionMetrics
    samples: list[SamplePrediction]
    evals: list[SampleEval]
    step: int
    seconds: float
    dropped: tuple[DroppedRecord, ...] = field(default_factory=tuple)


class Evaluator:
    """One held-out split scored through one rollout engine (the one training uses, or one built for ``eval``).
    ``pipeline`` encodes the prompts and parses the responses: training's ``Stage2Pipeline`` or a bare
    ``RolloutCodec`` (the ``eval`` command). ``samples``: an ``EvalSplit`` (its dropped records go into every
    result) or plain samples."""

    def __init__(self, pipeline: RolloutCodec, engine: Any, samples: Sequence[Sample], decoding: DecodingParams, *,
                 top_k: int = 5, resolution: int = DEFAULT_RESOLUTION, weight_sync: Any = None):
        if not samples:
            raise EvalSetupError("the eval split is empty")
        self.pipeline = pipeline
        self.engine = engine
        self.samples = list(samples)
        self.dropped = samples.dropped if isinstance(samples, EvalSplit) else ()
        self.decoding = greedy(decoding)
        self.top_k = top_k
        self.resolution = resolution
        self.weight_sync = weight_sync

    def run(self, model: Any = None, step: int = 0) -> EvalResult:
        start = time.perf_counter()
        if self.weight_sync is not None and model is not None:
            self.weight_sync.ensure_fresh(model, step)  # engines other than hf decode with their own weights
        requests, _ = self.pipeline.requests(self.samples)
        results = self.engine.generate(requests, self.decoding)
        check_prompt_alignment(requests, results)
        preds = predictions(self.pipeline, self.samples, results)
        metrics, evals = evaluate_samples(preds, top_k=self.top_k, resolution=self.resolution)
        return EvalResult(metrics, preds, evals, step, time.perf_counter() - start, self.dropped)


def dropped_note(dropped: Sequence[DroppedRecord], num_samples: int) -> str:
    """The ``metrics.md`` paragraph naming the held-out records left out (the first ``SHOWN_DROPPED``), or ``""``."""
    if not dropped:
        return ""
    shown = "".join(f"\n- {d.sample_id if d.sample_id is not None else '(no id)'}: {d.reason}"
                    for d in dropped[:SHOWN_DROPPED])
    more = f"\n- … {len(dropped) - SHOWN_DROPPED} more (metrics.json lists all)" if len(dropped) > SHOWN_DROPPED else ""
    return (f"**{len(dropped)} held-out records dropped** by the data checks (`data.on_bad_record: drop`); the "
            f"metrics are of the other {num_samples} samples:{shown}{more}\n\n")


def write_eval(out_dir: str | Path, result: EvalResult, title: str = "model") -> dict[str, Path]:
    """``metrics.json``, ``metrics.md`` and ``samples.jsonl`` under ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    m = result.metrics
    paths = {"json": out / "metrics.json", "markdown": out / "metrics.md", "samples": out / "samples.jsonl"}
    doc = {"title": title, "step": result.step, "seconds": result.seconds, "headline": m.flat(), **m.to_dict(),
           "dropped_records": len(result.dropped), "dropped": [d.to_json() for d in result.dropped]}
    paths["json"].write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    reasons = ", ".join(f"{k} {v}" for k, v in m.invalid_reasons.items()) or "none"
    failures = ", ".join(f"{k} {v}" for k, v in m.parse_failures.items()) or "none"
    paths["markdown"].write_text(
        f"# Held-out evaluation: {title}\n\n{m.num_samples} samples, {m.num_gt} GT objects, {m.num_pred} valid "
        f"predicted objects, {m.num_invalid} invalid (greedy decoding, step {result.step}).\n\n"
        + dropped_note(result.dropped, m.num_samples)
        + markdown_table([(title, m.flat())])
        + f"\nParse failures: {failures}. Invalid objects by reason: {reasons}.\n")
    with paths["samples"].open("w", encoding="utf-8") as fh:
        for s, e in zip(result.samples, result.evals):
            fh.write(json.dumps(sample_record(s, e), ensure_ascii=False) + "\n")
    return paths


class PeriodicEvalCallback(TrainerCallback):
    """Held-out eval during stage 2: at the start (after any stage-1 warm-up), every ``eval_steps`` optimizer steps
    and at the end. Every rank decodes the split (engines such as vLLM TP gather across ranks); the main process
    writes ``output_dir/eval/step-NNNNNN/`` and a ``phase: eval`` row with ``eval/*`` keys to ``metrics.jsonl``,
    and the same scalars to TensorBoard (``output_dir/eval``)."""

    def __init__(self, evaluator: Evaluator, model: Any, eval_steps: int, output_dir: str | Path,
                 metrics_path: str | Path, tensorboard: bool = True):
        self.evaluator = evaluator
        self.model = model
        self.eval_steps = eval_steps
        self.output_dir = Path(output_dir)
        self.writer = JsonlWriter(metrics_path)
        self.tensorboard = tensorboard
        self._tb: Any = None
        self.last_step: int | None = None
        self.results: list[EvalResult] = []

    def evaluate(self, state: Any) -> None:
        step = int(state.global_step)
        if self.last_step == step:
            return
        self.last_step = step
        result = self.evaluator.run(self.model, step)
        self.results.append(result)
        if not state.is_world_process_zero:
            return
        write_eval(self.output_dir / "eval" / f"step-{step:06d}", result, f"step {step}")
        scalars = {**result.metrics.flat(EVAL_PREFIX), f"{EVAL_PREFIX}seconds": result.seconds}
        self.writer.write({"phase": "eval", "step": step, "time": time.time(), **scalars})
        if self.tensorboard:
            if self._tb is None:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(self.output_dir / "eval"))
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        m = result.metrics
        log.info("eval step %d: F1@0.5 %.3f  AP %s  parse failures %.1f%%  (%.1fs)%s", step, m.at50.f1,
                 "n/a" if m.coco.ap is None else f"{m.coco.ap:.3f}", 100 * m.parse_failure_rate, result.seconds,
                 f"; {len(result.dropped)} held-out records dropped by the data checks" if result.dropped else "")

    def on_train_begin(self, args, state, control, **kwargs):
        self.evaluate(state)

    def on_step_end(self, args, state, control, **kwargs):
        if self.eval_steps and state.global_step % self.eval_steps == 0:
            self.evaluate(state)

    def on_train_end(self, args, state, control, **kwargs):
        self.evaluate(state)
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def resolve_checkpoint(cfg: Any, checkpoint: str | None) -> Path | None:
    """``None`` → the configured model as is; ``latest`` → ``output_dir/final`` if present, else the highest-step
    ``output_dir/stage2/checkpoint-*``; anything else: that directory (a full model or a peft adapter)."""
    if checkpoint is None:
        return None
    if checkpoint != "latest":
        path = Path(checkpoint)
        if not ((path / "config.json").is_file() or (path / "adapter_config.json").is_file()):
            raise EvalSetupError(f"--checkpoint {path}: no config.json or adapter_config.json there")
        return path
    root = Path(cfg.training.output_dir)
    final = root / "final"
    if (final / "config.json").is_file() or (final / "adapter_config.json").is_file():
        return final
    steps = sorted((int(p.name.rsplit("-", 1)[1]), p) for p in (root / "stage2").glob("checkpoint-*")
                   if p.name.rsplit("-", 1)[1].isdigit())
    if not steps:
        raise EvalSetupError(f"--checkpoint latest: neither {final} nor {root / 'stage2'}/checkpoint-* exists")
    return steps[-1][1]


def load_for_eval(cfg: Any, checkpoint: Path | None) -> tuple[Any, Any]:
    """(loaded, model): the configured model (tokenizer, processor), with the checkpoint's weights when given."""
    from trainer.modeling.loading import load_model

    loaded = load_model(cfg.model, cfg.training.output_dir)
    if checkpoint is None:
        return loaded, loaded.model
    if (checkpoint / "adapter_config.json").is_file():
        from peft import PeftModel

        return loaded, PeftModel.from_pretrained(loaded.model, str(checkpoint))
    import torch

    model = type(loaded.model).from_pretrained(str(checkpoint), dtype=getattr(torch, cfg.model.torch_dtype))
    loaded.model = model
    loaded.model_dir = checkpoint
    return loaded, model


def evaluate_config(cfg: Any, checkpoint: str | None = None, split: str | None = None) -> tuple[EvalResult, str]:
    """The ``eval`` command's work: returns the result and a title naming what was evaluated."""
    from trainer.modeling.prompts import PromptEncoder
    from trainer.rollout.factory import build_rollout_engine
    from trainer.sync.policy import build_weight_sync

    ckpt = resolve_checkpoint(cfg, checkpoint)
    samples = load_eval_samples(cfg, split)
    loaded, model = load_for_eval(cfg, ckpt)
    rm = cfg.rollout_matching
    d = rm.decoding
    engine = build_rollout_engine(rm, loaded, model)
    try:
        weight_sync = build_weight_sync(rm, engine, model)
        codec = RolloutCodec(PromptEncoder(loaded.tokenizer, loaded.image_processor, cfg.data.system_prompt))
        evaluator = Evaluator(codec, engine, samples,
                              DecodingParams(d.max_new_tokens, repetition_penalty=d.repetition_penalty),
                              top_k=rm.matching.candidate_top_k, weight_sync=weight_sync)
        result = evaluator.run(model, 0)
    finally:
        engine.close()
    return result, str(ckpt) if ckpt else "configured model (no checkpoint)"
