"""Load the policy model, tokenizer and (for VL models) image processor from a local directory or the
embedded tiny fixtures; wrap with a peft LoRA/DoRA adapter when configured."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedModel

from trainer.config.schema import ModelConfig, TunerConfig
from trainer.modeling.fixtures import TinyShape, save_tiny_model
from trainer.modeling.prepare import prepare_command, prepared_dir
from trainer.modeling.tokenizer import MissingCoordTokens, coord_token_ids

log = logging.getLogger(__name__)

VL_MODEL_TYPES = {"qwen3_vl", "qwen2_5_vl", "qwen2_vl", "qwen3_vl_moe"}
LANGUAGE_PROJECTIONS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)$"


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: Any
    image_processor: Any | None
    model_dir: Path
    model_type: str

    @property
    def multimodal(self) -> bool:
        return self.image_processor is not None

    @property
    def image_token_id(self) -> int | None:
        return getattr(self.model.config, "image_token_id", None)


class ModelPathError(ValueError):
    """``model.path`` cannot be loaded as it is (a user error); the message names the key and what to do."""


class CheckpointNotPrepared(ModelPathError):
    """``model.path`` is a stock checkpoint (its tokenizer lacks the coord tokens); the message says how to prepare it."""


class NotAModelDirectory(ModelPathError, FileNotFoundError):
    """``model.path`` is not a local model directory (no ``config.json`` in it)."""


def resolve_model_dir(cfg: ModelConfig, output_dir: str | Path) -> Path:
    """The model directory: ``model.path`` as given, or the tiny fixture materialised under ``output_dir``."""
    if cfg.path is not None:
        p = Path(cfg.path)
        if not (p / "config.json").is_file():
            what = "does not exist" if not p.exists() else "is not a model directory (no config.json in it)"
            raise NotAModelDirectory(
                f"model.path {p} {what}: set it to a local Hugging Face checkpoint directory (`python -m trainer model "
                "prepare --from <checkpoint> --out <dir>` writes one with the coord tokens), or use model.tiny")
        return p
    return save_tiny_model(Path(output_dir) / f"tiny-model-{cfg.tiny}", cfg.tiny, cfg.tiny_seed,
                           shape=TinyShape(**cfg.tiny_shape.model_dump()))


def load_image_processor(model_dir: Path):
    """AutoImageProcessor when torchvision is importable; the PIL Qwen2-VL processor otherwise."""
    if importlib.util.find_spec("torchvision") is not None:
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(model_dir)
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil.from_pretrained(model_dir)


def load_model(cfg: ModelConfig, output_dir: str | Path, dtype: torch.dtype | None = None) -> LoadedModel:
    """``dtype``: what to load the weights in (default ``model.torch_dtype``; float32 master weights:
    ``trainer.precision.load_dtype``)."""
    model_dir = resolve_model_dir(cfg, output_dir)
    hf_cfg = AutoConfig.from_pretrained(model_dir)
    dtype = dtype if dtype is not None else getattr(torch, cfg.torch_dtype)
    kwargs: dict[str, Any] = {"dtype": dtype}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    try:
        coord_token_ids(tokenizer)
    except MissingCoordTokens as exc:
        raise CheckpointNotPrepared(
            f"model.path {model_dir}: the tokenizer lacks {len(exc.missing)} of the 1000 coord tokens; run "
            f"`{prepare_command(model_dir)}` and set model.path to {prepared_dir(model_dir)}") from None
    if hf_cfg.model_type in VL_MODEL_TYPES:
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(model_dir, **kwargs)
        image_processor = load_image_processor(model_dir)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
        image_processor = None
    if model.get_input_embeddings().weight.shape[0] < len(tokenizer):
        raise ValueError(
            f"model at {model_dir} has {model.get_input_embeddings().weight.shape[0]} embeddings but the tokenizer has "
            f"{len(tokenizer)} tokens; resize the embeddings after adding the coord tokens"
        )
    return LoadedModel(model, tokenizer, image_processor, model_dir, hf_cfg.model_type)


def check_adapter_can_learn_coords(loaded: LoadedModel, tuner: TunerConfig) -> None:
    """A LoRA/DoRA adapter leaves the embedding and LM-head rows frozen (unless ``target_modules`` names
    ``embed_tokens`` or ``lm_head``), so the coord rows keep their prepared values: ``CheckpointNotPrepared`` when they
    are all one vector (``model prepare --init mean``), which no adapter could ever
    tell apart."""
    explicit = tuner.target_modules if isinstance(tuner.target_modules, list) else []
    if tuner.train_type == "full" or any(m in ("embed_tokens", "lm_head") for m in explicit):
        return
    ids = torch.tensor(coord_token_ids(loaded.tokenizer))
    for name, layer in (("input", loaded.model.get_input_embeddings()), ("LM-head", loaded.model.get_output_embeddings())):
        if layer is None:
            continue
        rows = layer.weight[ids]
        if torch.equal(rows, rows[:1].expand_as(rows)):
            raise CheckpointNotPrepared(
                f"model.path {loaded.model_dir}: the 1000 coord tokens share one {name} embedding row (prepared with "
                f"--init mean) and tuner.train_type {tuner.train_type} trains no embedding rows, so the model could "
                "never tell coordinates apart; prepare with --init number or set tuner.train_type: full")


def apply_tuner(model: PreTrainedModel, tuner: TunerConfig, multimodal: bool) -> PreTrainedModel:
    """Full fine-tuning (optionally freezing the ViT/aligner) or a peft LoRA/DoRA adapter."""
    if tuner.train_type == "full":
        if multimodal:
            for name, p in model.named_parameters():
                if (tuner.freeze_vit and ".visual." in f".{name}" and "merger" not in name) or (
                    tuner.freeze_aligner and "merger" in name
                ):
                    p.requires_grad_(False)
        return model
    from peft import LoraConfig, get_peft_model

    if tuner.target_modules == "all-linear":
        target: Any = LANGUAGE_PROJECTIONS if (multimodal and tuner.freeze_vit) else "all-linear"
    else:
        target = list(tuner.target_modules)
    lora = LoraConfig(r=tuner.lora_rank, lora_alpha=tuner.lora_alpha, lora_dropout=tuner.lora_dropout,
                      target_modules=target, use_dora=tuner.train_type == "dora", task_type="CAUSAL_LM")
    return get_peft_model(model, lora)
