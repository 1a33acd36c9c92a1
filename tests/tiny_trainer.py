"""A stage-2 ``RolloutMatchingTrainer`` over a tiny text model with the HF rollout backend, on the CPU: the trainer
that unit tests of the training loop drive (profiling, adapter casts, the heap freeze, the step's loss over ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainingArguments

from trainer.data.records import load_jsonl
from trainer.data.synthetic import generate
from trainer.modeling.coord_vocab import stop_token_ids
from trainer.modeling.fixtures import build_tiny_model, tiny_tokenizer
from trainer.modeling.prompts import PromptEncoder
from trainer.rollout.hf import HFRolloutEngine
from trainer.rollout.types import DecodingParams
from trainer.sft.settings import LayoutSettings, RolloutSettings, RuntimeSettings, TrainerSettings
from trainer.sft.stage2 import Stage2Pipeline
from trainer.sft.trainer import RolloutMatchingTrainer, SampleDataset


def tiny_stage2_trainer(tmp_path: Path, *, model=None, records: int = 2, max_steps: int = 1, bf16: bool = False,
                        samples=None, per_device: int = 2, target_source: str = "rollout",
                        trainer_class: type[RolloutMatchingTrainer] = RolloutMatchingTrainer,
                        args: dict[str, Any] | None = None, rollout: RolloutSettings | None = None,
                        layout: LayoutSettings | None = None, runtime: RuntimeSettings | None = None,
                        **trainer_kwargs: Any) -> RolloutMatchingTrainer:
    """``records`` synthetic records (``per_device`` per step; or the given ``samples``), rollouts of 8 new tokens
    (none with ``target_source='ground_truth'``), logging every step, nothing saved; ``model`` defaults to the tiny
    text model (seed 0); ``args`` override the ``TrainingArguments``; ``rollout`` / ``layout`` / ``runtime`` replace those
    settings (``trainer.sft.settings``); ``trainer_kwargs`` go to the trainer (packing, weight_sync, callbacks)."""
    tok = tiny_tokenizer()
    model = model if model is not None else build_tiny_model("text", seed=0)[0]
    if samples is None:
        samples = load_jsonl(generate(tmp_path / "data", records, seed=0, max_objects=2))
    arguments = TrainingArguments(**{
        "output_dir": str(tmp_path / "out"), "max_steps": max_steps, "per_device_train_batch_size": per_device,
        "learning_rate": 1e-5, "logging_steps": 1, "save_strategy": "no", "report_to": [], "bf16": bf16,
        "remove_unused_columns": False, "disable_tqdm": True, "use_cpu": True, **(args or {})})
    engine = (HFRolloutEngine(model, tok.pad_token_id, sorted(stop_token_ids(tok)), 2)
              if target_source == "rollout" else None)
    settings = TrainerSettings(target_source=target_source,
                               rollout=rollout or RolloutSettings(decoding=DecodingParams(max_new_tokens=8)),
                               layout=layout or LayoutSettings(), runtime=runtime or RuntimeSettings())
    return trainer_class(model=model, args=arguments, train_dataset=SampleDataset(samples),
                         pipeline=Stage2Pipeline(PromptEncoder(tok)), engine=engine, settings=settings,
                         processing_class=tok, **trainer_kwargs)
