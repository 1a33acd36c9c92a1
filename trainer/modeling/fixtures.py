"""Tiny models built in code (no hub): a Qwen3 text model and a Qwen3-VL-architecture model, both with the
embedded tokenizer (coord tokens, Qwen chat template). Random weights; head_dim 64 (vLLM's CPU kernels need ≥ 64).

``save_tiny_model(dir, kind)`` writes an ordinary HF model directory (config, safetensors, tokenizer, and for
``vl`` the processor), so every backend (HF, vLLM, the rollout server) loads it like a real checkpoint.
``stock=True`` builds a "stock" checkpoint instead: the same tokenizer without the coord tokens, the embeddings
sized to it (or to ``vocab_rows``, spare rows as in Qwen's padded vocabularies), which ``python -m trainer model
prepare`` turns into a trainable one.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from trainer.data.objects import DetObject
from trainer.data.output_format import coord_token, serialize_objects
from trainer.data.synthetic import COLORS, SHAPES
from trainer.modeling.prompts import DEFAULT_INSTRUCTION
from trainer.modeling.tokenizer import (
    IM_END,
    IMAGE_PAD,
    PAD_TOKEN,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    build_tokenizer,
)

TinyKind = Literal["text", "vl"]
HEAD_DIM = 64


@dataclass(frozen=True)
class TinyShape:
    """The sizes of a tiny model (``model.tiny_shape``): the language model's hidden size and layers, and the vision
    tower's (``vl``). Attention heads are 64 wide (vLLM's CPU kernels need >= 64); the default is the test fixture."""

    hidden_size: int = 128
    num_hidden_layers: int = 2
    vision_hidden_size: int = 64
    vision_depth: int = 2
    #: the image processor's largest image, in pixels (Qwen2-VL's ``max_pixels``); larger images are scaled down
    max_pixels: int = 128 * 128

    @property
    def num_position_embeddings(self) -> int:
        """The vision tower's learned position grid: one cell per 16 px patch of the largest image side (at least
        8 x 8; vLLM and transformers interpolate it to each image's grid)."""
        return max(8, math.isqrt(self.max_pixels) // 16) ** 2

    def __post_init__(self):
        for name in ("hidden_size", "vision_hidden_size"):
            if getattr(self, name) % HEAD_DIM:
                raise ValueError(f"model.tiny_shape.{name} must be a multiple of {HEAD_DIM}, got {getattr(self, name)}")
        if self.num_hidden_layers < 1 or self.vision_depth < 1:
            raise ValueError("model.tiny_shape: num_hidden_layers and vision_depth must be >= 1")
        if self.max_pixels < 32 * 32:
            raise ValueError(f"model.tiny_shape.max_pixels must be >= {32 * 32}, got {self.max_pixels}")

    @property
    def stamp(self) -> str:
        if self == TinyShape():
            return ""
        pixels = "" if self.max_pixels == TinyShape.max_pixels else f"@{self.max_pixels}"
        return f":{self.hidden_size}x{self.num_hidden_layers}/{self.vision_hidden_size}x{self.vision_depth}{pixels}"


def tokenizer_corpus(n: int = 400, seed: int = 1234) -> list[str]:
    """Text the embedded tokenizer is trained on: task answers, prompts and generic JSON/ASCII."""
    rng = random.Random(seed)
    texts = [DEFAULT_INSTRUCTION, "system", "user", "assistant", "Scene: ", '{"desc": "", "bbox_2d": [], "poly": []}']
    for _ in range(n):
        objs = []
        for _ in range(rng.randint(0, 5)):
            c = sorted(rng.sample(range(1000), 4))
            if rng.random() < 0.3:
                objs.append(DetObject(f"{rng.choice(sorted(COLORS))} {rng.choice(SHAPES)}", "poly", tuple(c[:2] + c[2:] + c[:2])))
            else:
                objs.append(DetObject(f"{rng.choice(sorted(COLORS))} {rng.choice(SHAPES)}", "bbox_2d", (c[0], c[1], c[2], c[3])))
        texts.append(serialize_objects(objs))
        texts.append("; ".join(f"{o.desc} " + "".join(coord_token(k) for k in o.coords) for o in objs))
    texts.extend(f"k{i}}}}} v{i}}}, w{i}}}}}, z{i}}}}}}}" for i in range(600))
    texts.append("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 .,:;!?'\"-_()[]{}<>/\\|@#$%^&*+=~`")
    return texts


@lru_cache(maxsize=2)
def _cached_tokenizer(coord_tokens: bool) -> PreTrainedTokenizerFast:
    return build_tokenizer(tokenizer_corpus(), coord_tokens=coord_tokens)


def tiny_tokenizer(stock: bool = False) -> PreTrainedTokenizerFast:
    """The embedded tokenizer (deterministic; built once per process; callers must not mutate it). ``stock``: without
    the coord tokens (every other id the same)."""
    return _cached_tokenizer(not stock)


def _text_kwargs(tok: PreTrainedTokenizerFast, vocab_rows: int | None = None, shape: TinyShape = TinyShape()) -> dict:
    heads = shape.hidden_size // HEAD_DIM
    return dict(
        vocab_size=max(len(tok), vocab_rows or 0),
        hidden_size=shape.hidden_size,
        intermediate_size=3 * shape.hidden_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        pad_token_id=tok.convert_tokens_to_ids(PAD_TOKEN),
        eos_token_id=tok.convert_tokens_to_ids(IM_END),
    )


def build_tiny_model(kind: TinyKind, seed: int = 0, stock: bool = False, vocab_rows: int | None = None,
                     tied: bool = True, shape: TinyShape = TinyShape()) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """``stock``: the tokenizer without coord tokens; ``vocab_rows``: at least this many embedding rows; ``tied``:
    ``tie_word_embeddings`` (False: a separate LM head, as Qwen3-VL-8B has); ``shape``: the sizes."""
    tok = tiny_tokenizer(stock)
    torch.manual_seed(seed)
    if kind == "text":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        cfg = Qwen3Config(**_text_kwargs(tok, vocab_rows, shape), tie_word_embeddings=tied, rope_theta=10000.0)
        model = Qwen3ForCausalLM(cfg)
    elif kind == "vl":
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

        text = _text_kwargs(tok, vocab_rows, shape)
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [12, 10, 10],
                                   "mrope_interleaved": True}
        cfg = Qwen3VLConfig(
            text_config=text,
            vision_config=dict(depth=shape.vision_depth, hidden_size=shape.vision_hidden_size,
                               intermediate_size=2 * shape.vision_hidden_size,
                               num_heads=shape.vision_hidden_size // HEAD_DIM, patch_size=16,
                               spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=shape.hidden_size,
                               num_position_embeddings=shape.num_position_embeddings,
                               deepstack_visual_indexes=[0]),
            image_token_id=tok.convert_tokens_to_ids(IMAGE_PAD),
            video_token_id=tok.convert_tokens_to_ids(VIDEO_PAD),
            vision_start_token_id=tok.convert_tokens_to_ids(VISION_START),
            vision_end_token_id=tok.convert_tokens_to_ids(VISION_END),
            tie_word_embeddings=tied,
        )
        model = Qwen3VLForConditionalGeneration(cfg)
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}; use 'text' or 'vl'")
    model.generation_config.eos_token_id = cfg.get_text_config().eos_token_id
    model.generation_config.pad_token_id = cfg.get_text_config().pad_token_id
    return model.eval(), tok


def build_tiny_image_processor(max_pixels: int = TinyShape.max_pixels):
    """The Qwen2/3-VL image processor (PIL backend: torchvision cannot load beside the CPU torch here); images above
    ``max_pixels`` are scaled down."""
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                    size={"shortest_edge": 32 * 32, "longest_edge": max_pixels})


def save_tiny_model(out_dir: str | Path, kind: TinyKind = "text", seed: int = 0, stock: bool = False,
                    vocab_rows: int | None = None, tied: bool = True, shape: TinyShape = TinyShape()) -> Path:
    """Write a tiny model directory (idempotent: an existing complete directory is reused); the options are
    ``build_tiny_model``'s."""
    out = Path(out_dir)
    marker = out / ".tiny-complete"
    stamp = (f"{kind}:{seed}" + (f":stock:{vocab_rows or 0}" if stock else "") + ("" if tied else ":untied")
             + shape.stamp)
    if marker.is_file() and marker.read_text() == stamp:
        return out
    model, tok = build_tiny_model(kind, seed, stock, vocab_rows, tied, shape)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    if kind == "vl":
        build_tiny_image_processor(shape.max_pixels).save_pretrained(out)
    marker.write_text(stamp)
    return out
