"""The one typed config schema. ``load_config(path)`` resolves ``extends``, validates every key and every
cross-key rule, and returns a ``TrainConfig`` before any model loads.

Namespaces follow the seeds: ``custom.trainer_variant``, ``custom.extra.rollout_matching.*``,
``custom.extra.rollout_server.*`` (GRPO ``swift rollout`` launch), ``rlhf.*`` (ms-swift RLHFArguments subset),
``training.*`` (incl. packing), ``model``, ``tuner``, ``data``, ``stage1`` (warm-up), ``deploy`` (job rendering).
"""

from __future__ import annotations

import difflib
import logging
import types
import typing
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import pydantic
from pydantic import Field, model_validator

from trainer.config.base import Section
from trainer.config.deploy import DeployConfig
from trainer.config.errors import ConfigError, ConfigErrors
from trainer.config.grpo import GRPO_VARIANT, RlhfConfig, RolloutServerConfig, check_grpo
from trainer.config.loader import resolve_yaml
from trainer.config.vllm import VllmConfig

log = logging.getLogger(__name__)


class TinyShapeConfig(Section):
    """``model.tiny_shape``: the sizes of the embedded tiny model (``trainer.modeling.fixtures.TinyShape``); the
    defaults are the test fixture's, ``configs/demo.yaml`` sets a larger detector."""

    hidden_size: int = Field(128, ge=64, le=2048, multiple_of=64)
    num_hidden_layers: int = Field(2, ge=1, le=32)
    vision_hidden_size: int = Field(64, ge=64, le=2048, multiple_of=64)
    vision_depth: int = Field(2, ge=1, le=32)
    max_pixels: int = Field(128 * 128, ge=32 * 32, le=2048 * 2048, description=(
        "the image processor's largest image in pixels (larger ones are scaled down); the vision tower's position grid "
        "follows it"))


class ModelConfig(Section):
    """Exactly one of ``path`` (a local HF model directory) or ``tiny`` (build the embedded tiny model)."""

    path: str | None = None
    tiny: Literal["text", "vl"] | None = None
    tiny_seed: int = 0
    tiny_shape: TinyShapeConfig = Field(default_factory=TinyShapeConfig)
    torch_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.path is None) == (self.tiny is None):
            raise ValueError("set exactly one of model.path (a local model directory) or model.tiny (text|vl)")
        return self


class TunerConfig(Section):
    train_type: Literal["full", "lora", "dora"] = "full"
    lora_rank: int = Field(8, ge=1)
    lora_alpha: int = Field(16, ge=1)
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    freeze_vit: bool = True
    freeze_aligner: bool = True


class SyntheticDataConfig(Section):
    num_samples: int = Field(256, ge=1)
    seed: int = 0
    min_objects: int = Field(1, ge=0)
    max_objects: int = Field(4, ge=1)
    image_size: int = Field(64, ge=16)
    poly_fraction: float = Field(0.0, ge=0.0, le=1.0)
    eval_num_samples: int = Field(0, ge=0, description="held-out synthetic eval split size (0: none)")
    eval_seed: int | None = Field(None, description="seed of the eval split (default: seed + 1; must differ from seed)")
    min_object_px: int | None = Field(None, ge=1, description="an object's smallest side in pixels (None: image_size // 8)")
    max_object_px: int | None = Field(None, ge=1, description="an object's largest side in pixels (None: image_size // 3)")
    max_overlap: float = Field(1.0, ge=0.0, le=1.0, description=(
        "largest share of an object's box that another object's box may cover (one that cannot be placed is left out; "
        "1.0: no bound)"))
    clutter: int = Field(0, ge=0, description="unannotated grey strokes and dots drawn in each image")
    varied_background: bool = Field(False, description="a random light background colour per image")

    @model_validator(mode="after")
    def _held_out(self) -> SyntheticDataConfig:
        if self.eval_seed is not None and self.eval_seed == self.seed:
            raise ValueError("eval_seed must differ from seed (the eval split must be held out)")
        lo = self.min_object_px if self.min_object_px is not None else self.image_size // 8
        hi = self.max_object_px if self.max_object_px is not None else self.image_size // 3
        if not 1 <= lo <= hi < self.image_size - 1:
            raise ValueError(f"object sizes {lo}..{hi} px (min_object_px..max_object_px) must satisfy 1 <= min <= max "
                             f"< image_size - 1 ({self.image_size - 1})")
        return self


class DataConfig(Section):
    """Exactly one of ``train_jsonl`` or ``synthetic``; at most one eval split (``eval_jsonl`` or
    ``synthetic.eval_num_samples``)."""

    train_jsonl: str | None = None
    eval_jsonl: str | None = None
    synthetic: SyntheticDataConfig | None = None
    image_root: str | None = None
    system_prompt: str | None = None
    on_bad_record: Literal["error", "drop"] = "error"

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if (self.train_jsonl is None) == (self.synthetic is None):
            raise ValueError("set exactly one of data.train_jsonl or data.synthetic")
        if self.eval_jsonl is not None and self.synthetic is not None and self.synthetic.eval_num_samples:
            raise ValueError("set at most one eval split: data.eval_jsonl or data.synthetic.eval_num_samples")
        return self

    @property
    def has_eval_split(self) -> bool:
        return self.eval_jsonl is not None or bool(self.synthetic and self.synthetic.eval_num_samples)


class TrainingConfig(Section):
    output_dir: str = "runs/default"
    max_steps: int = Field(-1, ge=-1, description="stage-2 optimizer steps (-1: one epoch of the data). 0: the "
                           "stage-1 warm-up alone, scored on the held-out split and saved to output_dir/final, a "
                           "checkpoint stage-2 runs and their control start from (with stage1.steps: 0)")
    num_train_epochs: float = Field(1.0, gt=0)
    per_device_train_batch_size: int = Field(
        1, ge=1, description="records per rank per micro-batch; stage 2 decodes per_device_train_batch_size x "
        "gradient_accumulation_steps records per rank per optimizer step unless records_per_step is set, and trains "
        "padded batches of this many targets (packing off)")
    gradient_accumulation_steps: int = Field(1, ge=1)
    records_per_step: int | None = Field(
        None, ge=1, description="records (raw samples) per optimizer step over all data-parallel ranks, as TRL's "
        "generation_batch_size or verl's train_batch_size: decoded in one batched call per rank (spread over every "
        "healthy rollout server), then trained as every packed row they fill (packing) or padded micro-batches of "
        "per_device_train_batch_size targets, gradients accumulated into one optimizer step; must be a multiple of "
        "the data-parallel world size. null: per_device_train_batch_size x gradient_accumulation_steps x world size")
    learning_rate: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_ratio: float = Field(0.0, ge=0, le=1)
    lr_scheduler_type: Literal["constant", "linear", "cosine", "constant_with_warmup"] = "constant"
    max_grad_norm: float = Field(1.0, gt=0)
    seed: int = 42
    logging_steps: int = Field(1, ge=1)
    eval_steps: int = Field(0, ge=0, description="held-out eval every N stage-2 steps (0: only before and after "
                                                 "stage 2); needs data.eval_jsonl or data.synthetic.eval_num_samples")
    save_steps: int = Field(0, ge=0)
    save_total_limit: int | None = Field(None, ge=1)
    bf16: bool = False
    gradient_checkpointing: bool = Field(
        False, description="true: checkpoint every decoder layer (gradient_checkpointing_policy: full); "
                           "gradient_checkpointing_policy, when set, supersedes it (so a config extending one that "
                           "sets the bool only needs the policy)")
    gradient_checkpointing_policy: Literal["full", "selective", "off", "auto"] | None = Field(
        None, description="full: recompute every decoder layer in the backward (HF's checkpointing); selective: only "
        "every gradient_checkpointing_every_n_layers-th layer (HF's every_n_layers), the others keep their "
        "activations; off: none; auto: chosen at start-up from an activation estimate against the GPU's memory "
        "after weights, gradients and optimizer states (trainer.modeling.checkpointing.choose_checkpointing): off "
        "where it fits, selective where it almost does, full otherwise. The policy that ran is the first metrics "
        "row's train/checkpointing_policy. null: follow gradient_checkpointing (true: full, false: off)")
    gradient_checkpointing_every_n_layers: int | None = Field(
        None, ge=2, description="selective: checkpoint every n-th decoder layer (null: 2, i.e. half the layers); "
                                "auto: the only selective spacing it considers (null: 4, 3 and 2)")
    use_liger_kernel: bool = Field(
        False, description="Liger Kernel's fused RMSNorm, SwiGLU and RoPE in the Qwen3 / Qwen3-VL text model (its "
        "loss kernels stay off: the loss is the chunked objective over supervised rows); needs the 'liger' extra "
        "(Triton, a CUDA GPU): pip install 'rollout-matching[liger]'")
    optim: Literal["adamw_torch", "adamw_torch_fused"] = Field(
        "adamw_torch_fused", description="HF TrainingArguments.optim: adamw_torch_fused (torch's fused AdamW, "
        "transformers' own default with torch >= 2.8, so what every run before this key used) or adamw_torch "
        "(the for-each implementation)")
    compile_decoder_layers: bool = Field(
        False, description="torch.compile each decoder layer (dynamic shapes) for the teacher-forced step; HF-backend "
                           "rollouts stay eager unless rollout_matching.hf.compile is on")
    compile_activation_memory_budget: float | Literal["auto"] = Field(
        1.0, description="with compile_decoder_layers: the share of the activations torch.compile's partitioner keeps "
        "for the backward of each un-checkpointed layer, against what it keeps by default "
        "(torch._functorch.config.activation_memory_budget, process-wide), in (0, 1]. Below 1 it recomputes the "
        "cheapest part of the layer in the backward instead (0.5: the q/k/v projections and the attention; 0.4: the "
        "whole attention block; 0.3: also the MLP's up projection), so a longer row fits without gradient "
        "checkpointing at a fraction of its recompute (H100, 16k rows: 4B full 1.13x the forward + backward of full "
        "checkpointing at 0.4, 8B LoRA 1.17x at 0.3). 1: the default partitioner. auto (with "
        "gradient_checkpointing_policy: auto): no checkpointing at the largest of 1, 0.5, 0.4, 0.3 whose estimate fits, "
        "before any checkpointing is considered. Needs compile_decoder_layers; no effect on checkpointed layers "
        "(gradient_checkpointing_policy: full refuses a number below 1). The budget that ran is the first metrics row's "
        "train/compile_activation_memory_budget")
    packed_varlen_kernel: Literal["op", "api"] = Field(
        "op", description="the attention of packed rows on a CUDA GPU without flash-attn (every Qwen3-VL pack): op "
        "(trainer.packing.varlen_kernel: a torch custom op over aten's flash kernels; grouped-query attention without "
        "repeating the keys and values, and one call inside a compiled decoder layer, so each layer compiles to one "
        "region) or api (torch.nn.attention.varlen.varlen_attn with the keys and values repeated, kept out of compiled "
        "graphs: the fallback where aten's private flash signatures differ). The one that ran is the first metrics "
        "row's train/packed_attention")
    dataloader_num_workers: int = Field(0, ge=0)
    report_to: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["jsonl", "tensorboard"], description="where the metrics go (docs/reference/"
        "metrics.md). jsonl: <output_dir>/metrics.jsonl, written whatever this says. tensorboard: HF Trainer's "
        "writer (<output_dir>/stage1/runs and stage2/runs, keys prefixed train/) and the eval scalars under "
        "<output_dir>/eval. "
        "wandb (extra wandb: Weights & Biases; WANDB_PROJECT, WANDB_MODE=offline, WANDB_DIR, default output_dir) "
        "and mlflow (extra mlflow: mlflow-skinny with SQLAlchemy; MLFLOW_TRACKING_URI, a tracking server or "
        "sqlite:///mlflow.db, not a file: store; MLFLOW_EXPERIMENT_NAME): one run each, every "
        "metrics.jsonl row (setup, stage1, stage2, eval) logged as it is written, under the same names at the "
        "row's step (MLflow turns characters it refuses, such as @, into _); rank 0 only. Summary GRPO passes these "
        "to ms-swift's trainer (HF's own callbacks)")
    deepspeed: str | None = None
    disable_tqdm: bool = False
    packing: bool = False
    packing_length: int | None = Field(None, ge=16)
    packing_buffer: int = Field(256, ge=1)
    packing_min_fill_ratio: float = Field(0.65, ge=0.0, le=1.0)
    packing_drop_last: bool = True
    profile_steps: list[int] = Field(
        default_factory=list, description="stage-2 optimizer steps (1-based) whose weight sync and forward + "
        "backward of every packed row are profiled with torch.profiler: "
        "<output_dir>/stage2/profile/step<N>_{weight_sync,train}.json (seconds per kernel category, GPU busy fraction, "
        "top kernels, and for train the host's waits for the GPU) and step<N>_<region>_kernels.txt")
    phase_timing: Literal["events", "sync"] = Field(
        "events", description="how each packed row's forward is timed into time/forward_s on a GPU (time/backward_s "
        "is the rest of the step's training, which ends in one wait for the device either way). events: CUDA events "
        "around the forward, read once at the step's end, so the host launches the next row's work while the device "
        "still runs this one's; the loss terms stay on the device until logged. sync: the device is synchronized at "
        "the end of every forward (each row's forward time is the host's wait for it; what every run before this key "
        "did), for a per-row split that needs no events. CPU runs time the wall either way")
    host_vision_metadata: bool = Field(
        True, description="Qwen3-VL packed rows: keep image_grid_thw on the host and make the vision encoder's "
        "metadata (attention segments, rotary positions, position-embedding interpolation) there with transformers' "
        "own helpers, so the encoder reads no GPU value back (about eighty host waits a packed row at 4B otherwise), "
        "and merge the deepstack features at image-token positions the collator found on the host instead of through "
        "a boolean mask (trainer.modeling.vision_metadata). Other models: no effect. false: both on the GPU")
    cpu_threads_per_rank: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="torch's intra-op CPU threads in each learner rank (the image processor, the packing's "
        "pixel concatenation; on a CPU-only machine the training itself). auto: an OMP_NUM_THREADS you set is kept, "
        "except the 1 torchrun sets when it starts several ranks; then, without a CUDA GPU, 1 thread per rank (the "
        "small models CPU runs train are fastest on one: 50 stage-1 and 5 stage-2 steps of "
        "configs/demo_from_stock.yaml took 39 s on 1 against 119 s on torch's default of 2 on a 2-core machine); "
        "with a GPU, torchrun's 1 becomes the node's physical cores (within the CPU affinity and a container's CPU "
        "quota) / local ranks (as accelerate launch does), one rank without it keeps torch's default, and a rank "
        "bound to its own cores (training.cpu_affinity) gets one thread per core of its block. A count: that many "
        "(1 keeps torchrun's). Recorded as train/cpu_threads_per_rank in metrics.jsonl's setup row "
        "(trainer.sft.cpu_threads)")
    cpu_affinity: Literal["auto", "node", "off"] = Field(
        "auto", description="auto: with several learner ranks on one host, bind each (every thread, its in-process "
        "vLLM engine's included) to its own contiguous block of whole physical cores within the CPU affinity, so one "
        "rank's image processing never runs on the cores another rank's engine decodes on; one rank is not bound. "
        "node: each rank takes the block of its host GPU (CUDA_VISIBLE_DEVICES) among one block per GPU of the host, "
        "the blocks rollout servers started with `launch server --cpu-affinity node` take for theirs (layouts with "
        "servers and a learner on one node). off: the OS schedules every thread anywhere. Recorded as "
        "train/cpu_affinity in metrics.jsonl's setup row (trainer.sft.cpu_threads)")
    freeze_heap_after_first_step: bool = Field(
        True, description="freeze Python's heap (gc.collect, then gc.freeze) once more when the stage's first "
        "optimizer step ends, as it is frozen once before training: what that step built for the whole run (the "
        "compiled decoder layers' Dynamo and Inductor caches, the optimizer's state, the engine's warm-up) then stays "
        "out of every later full collection, such as the one vLLM's level-1/2 sleep runs each step (8B LoRA on an "
        "H100, 2026-11-28: one gen-2 collection a step, 0.13-0.21 s of gc pause, most of a 0.17-0.26 s sleep; frozen, "
        "on an H200, 2026-11-28: gc pause 0.013-0.015 s, sleep 0.05-0.07 s). "
        "Cyclic garbage made from objects alive at that moment is not collected until training ends (run_training "
        "unfreezes)")
    profile_trace: bool = Field(False, description="also write a gzipped Chrome trace per profiled step "
                                                   "(step<N>_<region>.trace.json.gz; tens of MB at 8B)")
    metrics_port: int | None = Field(None, ge=1, le=65535, description="serve the learner's Prometheus metrics "
                                     "(step timers, rollout counts, quarantines) on this port; null: off")
    metrics_host: str = Field("127.0.0.1", description="bind address of metrics_port (environment variables such "
                                                       "as ${POD_IP} are expanded)")

    @model_validator(mode="after")
    def _liger_or_compile(self) -> TrainingConfig:
        if self.use_liger_kernel and self.compile_decoder_layers:
            raise ValueError("use_liger_kernel and compile_decoder_layers do not combine: torch.compile cannot trace "
                             "Liger's Triton RMSNorm (Dynamo AssertionError at the decoder layer's input_layernorm, "
                             "H100, liger-kernel 0.8.5, torch 2.11); set one of them false (measured: Liger 1.35x on "
                             "the forward + backward at 4B full, compile 1.32x at 8B LoRA; docs/guides/levers.md)")
        return self

    @model_validator(mode="after")
    def _memory_budget_needs_compiled_layers(self) -> TrainingConfig:
        budget = self.compile_activation_memory_budget
        if budget == "auto":
            if not self.compile_decoder_layers or self.checkpointing_policy != "auto":
                raise ValueError("compile_activation_memory_budget auto needs compile_decoder_layers: true and "
                                 "gradient_checkpointing_policy: auto (it is chosen with the policy); set both or give "
                                 "a number in (0, 1]")
            return self
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"compile_activation_memory_budget {budget!r}: a fraction in (0, 1], or auto")
        if budget < 1.0:
            if not self.compile_decoder_layers:
                raise ValueError(f"compile_activation_memory_budget {budget:g} needs compile_decoder_layers: true (the "
                                 "budget steers torch.compile's partitioner); set it or drop the budget")
            if self.checkpointing_policy == "full":
                raise ValueError(f"compile_activation_memory_budget {budget:g} has no effect with "
                                 "gradient_checkpointing_policy full (every layer already recomputes its forward): set "
                                 "the policy to off, selective or auto, or drop the budget")
        return self

    @model_validator(mode="after")
    def _one_checkpointing_switch(self) -> TrainingConfig:
        if self.gradient_checkpointing_every_n_layers is not None and self.checkpointing_policy not in ("selective",
                                                                                                        "auto"):
            raise ValueError(f"gradient_checkpointing_every_n_layers only applies with gradient_checkpointing_policy "
                             f"selective or auto, not {self.checkpointing_policy}; drop it or set the policy")
        return self

    @property
    def checkpointing_policy(self) -> str:
        """The requested policy: ``gradient_checkpointing_policy``, else the bool (true: full, false: off)."""
        if self.gradient_checkpointing_policy is not None:
            return self.gradient_checkpointing_policy
        return "full" if self.gradient_checkpointing else "off"


class Stage1Config(Section):
    """Optional teacher-forced warm-up on ground truth before stage 2 (so rollouts parse on a fresh model)."""

    #: ``learning_rate: auto``: (upper bound on the model's parameters, full fine-tuning rate, LoRA/DoRA rate), the
    #: first row whose bound the loaded model is under (vision tower included; the LoRA rate is the adapter's)
    AUTO_LEARNING_RATES: ClassVar[tuple[tuple[float, float, float], ...]] = (
        (5e7, 3e-3, 3e-3),          # random test/demo models (the embedded tiny ones)
        (3e9, 2e-5, 2e-4),          # Qwen3-VL-2B
        (6e9, 1e-5, 1e-4),          # Qwen3-VL-4B
        (2e10, 1e-5, 1e-4),         # Qwen3-VL-8B
        (float("inf"), 5e-6, 5e-5),  # larger
    )

    steps: int = Field(0, ge=0)
    learning_rate: Annotated[float, Field(gt=0)] | Literal["auto"] = Field(
        "auto", description="the warm-up's learning rate, or auto: by the model's parameter count and "
        "tuner.train_type (Stage1Config.AUTO_LEARNING_RATES: under 50M parameters 3e-3; under 3B 2e-5 full / 2e-4 "
        "LoRA; under 6B and under 20B 1e-5 / 1e-4; larger 5e-6 / 5e-5). The rate that ran is each stage-1 metrics "
        "row's learning_rate")
    batch_size: int = Field(16, ge=1)
    logging_steps: int = Field(25, ge=1)
    bf16: bool | Literal["auto"] = Field(
        "auto", description="bf16 mixed precision in the warm-up; auto: on where training.bf16 is or the model is "
                            "loaded in bfloat16 (model.torch_dtype)")
    target_workers: Annotated[int, Field(ge=0, le=64)] | Literal["auto"] = Field(
        "auto", description="data-loader worker processes per rank that build the warm-up's ground-truth targets "
        "(prompt tokens, pixels, answer tokens) ahead of the step that trains them; 0: in the step. auto: 0 without "
        "a CUDA device, else up to 4, leaving each rank one core of its share (the count is logged as the warm-up "
        "starts)")

    def resolved_learning_rate(self, num_parameters: int, train_type: str) -> float:
        """``learning_rate``, with ``auto`` looked up in ``AUTO_LEARNING_RATES``."""
        if self.learning_rate != "auto":
            return float(self.learning_rate)
        for bound, full, adapter in self.AUTO_LEARNING_RATES:
            if num_parameters < bound:
                return full if train_type == "full" else adapter
        raise AssertionError("the last AUTO_LEARNING_RATES bound is infinite")

    def resolved_bf16(self, training_bf16: bool, torch_dtype: str) -> bool:
        return (training_bf16 or torch_dtype == "bfloat16") if self.bf16 == "auto" else bool(self.bf16)


class DecodingConfig(Section):
    max_new_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    repetition_penalty: float = Field(1.0, gt=0.0)
    seed: int | None = None


class MatchingConfig(Section):
    mask_iou_threshold: float = Field(0.3, ge=0.0, le=1.0)
    candidate_top_k: int = Field(5, ge=1)
    mask_resolution: int = Field(256, ge=16, le=2048)
    prefix: Literal["all", "until_first_error"] = Field(
        "until_first_error", description="which of a rollout's objects the target keeps as its prefix: "
        "until_first_error (the objects before the first false positive or invalid one; the rest of the answer is "
        "dropped and every GT they did not match is appended, so no target teaches the model to go on after a "
        "mistake; rollout/prefix_dropped counts the objects cut off) or all (every complete object, false positives "
        "and invalid ones included, without loss: with the junction trained, a weak detector then learns to go on "
        "after its false positives, and its answers run away)")


class LossConfig(Section):
    text_ce_weight: float = Field(1.0, ge=0.0)
    coord_softce_weight: float = Field(1.0, ge=0.0)
    coord_w1_weight: float = Field(1.0, ge=0.0)
    coord_gate_weight: float = Field(1.0, ge=0.0)
    coord_sigma: float = Field(2.0, gt=0.0)
    tail_desc_ce: bool = Field(
        True, description="the FN append's desc value tokens get full-vocabulary CE, as the rest of its text does. "
                          "false (the method as first specified): desc values in the tail get no loss, so stage 2 "
                          "trains no description at all (the rollout prefix gets no CE either), and a weak warm-up "
                          "model forgets how to write one: on the CPU demo (seed 0, 40 steps) the held-out "
                          "parse-failure rate went 0 % -> 95.5 % with false and stayed 0 % with true "
                          "(docs/concepts/decisions.md)")
    supervised_logits_only: bool = Field(
        True, description="project the LM head only at positions that carry a CE label or a coord slot (prompt, "
                          "image and unsupervised rollout-prefix tokens get no logits); with coord_gate_weight 0 the "
                          "coord rows use only the coord-token columns. false: full [B, T, V] logits")
    logit_chunk_rows: int | None = Field(
        1024, ge=1, description="with supervised_logits_only: project and reduce the supervised rows this many at a "
                                "time, recomputing each chunk's LM-head projection in the backward, so the loss holds "
                                "chunk x vocabulary logits instead of all supervised rows x vocabulary (~10 GiB less "
                                "at a 16k-token Qwen3-VL pack); null: all rows at once")


class PolyConfig(Section):
    sinkhorn_epsilon: float = Field(0.05, gt=0.0)
    sinkhorn_iters: int = Field(50, ge=1)


class RolloutBufferConfig(Section):
    enabled: bool = False
    m_steps: int = Field(1, ge=1)


class OffloadConfig(Section):
    enabled: bool = False
    offload_model: bool = True
    offload_optimizer: bool = True


class HfRolloutConfig(Section):
    """``custom.extra.rollout_matching.hf``: speed knobs of the HF ``generate`` backend. Greedy results do not
    depend on them (tests/unit/test_rollout_hf.py); ``compile`` needs the static cache (fixed decoding shapes)."""

    cache_implementation: Literal["dynamic", "static"] = "dynamic"
    compile: bool = False
    compile_mode: Literal["reduce-overhead", "default", "max-autotune", "max-autotune-no-cudagraphs"] = "reduce-overhead"
    prompt_pad_multiple: int = Field(1, ge=1, le=4096)

    @model_validator(mode="after")
    def _compile_needs_static(self) -> HfRolloutConfig:
        if self.compile and self.cache_implementation != "static":
            raise ValueError("compile: true needs cache_implementation: static (compiled decoding needs fixed shapes; "
                             "with the dynamic cache every step would recompile)")
        return self


class MismatchConfig(Section):
    """``custom.extra.rollout_matching.mismatch``: the train-inference mismatch measured every stage-2 step
    (``mismatch/*`` metrics): the engine returns each sampled token's log-probability, the learner's teacher-forced
    forward gives its own at the rollout tokens the target keeps."""

    enabled: bool = Field(True, description="request the engine's log-probability of every sampled token and log "
                                            "mismatch/logp_abs_diff_mean, mismatch/logp_abs_diff_max, mismatch/kl_k3 "
                                            "and mismatch/tokens each logged step")
    warn_mean_abs_diff: float = Field(
        0.05, gt=0.0, description="warn when a logged step's mean |log p_engine - log p_learner| (nats per kept "
                                  "rollout token) exceeds this: the engine is not decoding with the learner's policy "
                                  "(a skipped or lossy weight sync, a stale engine, an adapter that did not arrive)")


class RolloutMatchingConfig(Section):
    rollout_backend: Literal["vllm", "hf"] = "vllm"
    targets: Literal["rollout", "ground_truth"] = Field(
        "rollout", description="what stage 2 trains on: rollout (rollout-matching targets: rollout prefix + FN append) "
        "or ground_truth (the control: stage 1 continued on ground-truth targets for the same records, steps, "
        "schedule and held-out evals, no rollouts; a stage-2 gain counts when it beats this)")
    rollout_generate_batch_size: int = Field(1, ge=1)
    hf: HfRolloutConfig = Field(default_factory=HfRolloutConfig)
    decoding: DecodingConfig = Field(default_factory=DecodingConfig)
    matching: MatchingConfig = Field(default_factory=MatchingConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    poly: PolyConfig = Field(default_factory=PolyConfig)
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    rollout_buffer: RolloutBufferConfig = Field(default_factory=RolloutBufferConfig)
    offload: OffloadConfig = Field(default_factory=OffloadConfig)
    mismatch: MismatchConfig = Field(default_factory=MismatchConfig)

    @model_validator(mode="after")
    def _pixels_during_decode_needs_vllm(self) -> RolloutMatchingConfig:
        if self.vllm.pixels_during_decode and self.rollout_backend != "vllm":
            raise ValueError("vllm.pixels_during_decode needs rollout_backend: vllm (the hf backend decodes from the "
                             "pixels themselves)")
        return self


class ExtraConfig(Section):
    rollout_matching: RolloutMatchingConfig | None = None
    rollout_server: RolloutServerConfig | None = None


class CustomConfig(Section):
    trainer_variant: Literal["rollout_matching_sft", "grpo_summary"] = "rollout_matching_sft"
    extra: ExtraConfig = Field(default_factory=ExtraConfig)


class TrainConfig(Section):
    model: ModelConfig
    data: DataConfig
    tuner: TunerConfig = Field(default_factory=TunerConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    stage1: Stage1Config = Field(default_factory=Stage1Config)
    custom: CustomConfig = Field(default_factory=CustomConfig)
    rlhf: RlhfConfig | None = None
    deploy: DeployConfig = Field(default_factory=DeployConfig)

    @property
    def rollout_matching(self) -> RolloutMatchingConfig:
        rm = self.custom.extra.rollout_matching
        if rm is None:
            raise ConfigError("custom.extra.rollout_matching", "missing (required by trainer_variant rollout_matching_sft)")
        return rm


def _unwrap_models(annotation: Any) -> list[type[pydantic.BaseModel]]:
    """BaseModel classes reachable from an annotation (through Optional/Union/list/dict)."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, list, tuple, dict, typing.Annotated):
        out: list[type[pydantic.BaseModel]] = []
        for arg in typing.get_args(annotation):
            out.extend(_unwrap_models(arg))
        return out
    return []


def _fields_at(model: type[pydantic.BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names of the section at ``loc`` (a pydantic error location without its last item)."""
    candidates = [model]
    for part in loc:
        if isinstance(part, int):
            continue
        nxt: list[type[pydantic.BaseModel]] = []
        for m in candidates:
            field = m.model_fields.get(str(part))
            if field is not None:
                nxt.extend(_unwrap_models(field.annotation))
        if not nxt:
            return []
        candidates = nxt
    return sorted({name for m in candidates for name in m.model_fields})


def _dotted(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif "[" in str(p) or str(p) in ("function-after", "function-before"):
            continue
        else:
            parts.append(("." if parts else "") + str(p))
    return "".join(parts)


def errors_from_validation(exc: pydantic.ValidationError) -> list[ConfigError]:
    out: list[ConfigError] = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-"))))
        path = _dotted(loc)
        if err["type"] == "extra_forbidden":
            known = _fields_at(TrainConfig, loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys here: {', '.join(known)}"
            out.append(ConfigError(path, f"unknown key; {hint}"))
        elif err["type"] == "missing":
            out.append(ConfigError(path, "required key is missing"))
        else:
            msg = err["msg"].removeprefix("Value error, ")
            got = err.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            out.append(ConfigError(path, f"{msg}{shown}"))
    return out


def check_combinations(cfg: TrainConfig) -> list[ConfigError]:
    """Cross-key rules that no single field can express."""
    errs: list[ConfigError] = []
    t = cfg.training
    variant = cfg.custom.trainer_variant
    if t.deepspeed is not None:
        from trainer.config.deepspeed import problem

        why = problem(t.deepspeed)
        if why:
            errs.append(ConfigError("training.deepspeed", why))
        elif variant == "rollout_matching_sft":
            from trainer.config.deepspeed import zero_stage

            rm_cfg = cfg.custom.extra.rollout_matching
            if rm_cfg is not None and rm_cfg.rollout_backend == "vllm" and zero_stage(t.deepspeed) == 3:
                errs.append(ConfigError("training.deepspeed", f"{t.deepspeed!r} is ZeRO-3, which partitions the "
                                        "weights every vLLM weight sync reads (colocate and servers); use zero2 or "
                                        "zero2_offload, or rollout_backend: hf"))
    if t.max_steps == 0 and variant == "rollout_matching_sft" and cfg.stage1.steps == 0:
        errs.append(ConfigError("training.max_steps", "0 runs the stage-1 warm-up alone, but stage1.steps is 0: "
                                "set stage1.steps, or max_steps > 0 for stage 2"))
    bad_steps = [n for n in t.profile_steps if n < 1 or (t.max_steps > 0 and n > t.max_steps)]
    if bad_steps:
        errs.append(ConfigError("training.profile_steps", f"{bad_steps} outside 1..max_steps ({t.max_steps}): list "
                                "stage-2 optimizer steps, counted from 1"))
    if t.profile_trace and not t.profile_steps:
        errs.append(ConfigError("training.profile_trace", "has no effect without training.profile_steps; list the "
                                "steps to profile or drop profile_trace"))
    if t.eval_steps and not cfg.data.has_eval_split:
        errs.append(ConfigError("training.eval_steps", "needs an eval split: set data.eval_jsonl or "
                                "data.synthetic.eval_num_samples (or set eval_steps: 0)"))
    if variant == "rollout_matching_sft":
        rm = cfg.custom.extra.rollout_matching
        if rm is None:
            errs.append(ConfigError("custom.extra.rollout_matching", "required when custom.trainer_variant is rollout_matching_sft"))
            return errs
        if t.packing:
            if t.packing_length is None:
                errs.append(ConfigError("training.packing_length", "required when training.packing is true (tokens per packed row)"))
            if not t.packing_drop_last:
                errs.append(ConfigError(
                    "training.packing_drop_last",
                    "must be true for stage-2 post-rollout packing (carry-only mode never flushes a partial pack); set it to true",
                ))
        lo = rm.loss
        if not lo.supervised_logits_only and "logit_chunk_rows" in lo.model_fields_set and lo.logit_chunk_rows:
            errs.append(ConfigError("custom.extra.rollout_matching.loss.logit_chunk_rows",
                                    "only applies with loss.supervised_logits_only: true (full [B, T, V] logits are "
                                    "computed at once); drop it or set supervised_logits_only: true"))
        if rm.rollout_buffer.m_steps > 1 and not rm.rollout_buffer.enabled:
            errs.append(ConfigError("custom.extra.rollout_matching.rollout_buffer.m_steps",
                                    "m_steps > 1 has no effect unless rollout_buffer.enabled is true; enable it or set m_steps: 1"))
        v = rm.vllm
        if rm.rollout_backend == "vllm":
            if v.mode == "colocate" and v.max_model_len is None:
                errs.append(ConfigError("custom.extra.rollout_matching.vllm.max_model_len",
                                        "required for the vllm colocate backend (must cover prompt + decoding.max_new_tokens)"))
            if v.max_model_len is not None and v.max_model_len <= rm.decoding.max_new_tokens:
                errs.append(ConfigError("custom.extra.rollout_matching.vllm.max_model_len",
                                        f"{v.max_model_len} leaves no room for the prompt with decoding.max_new_tokens="
                                        f"{rm.decoding.max_new_tokens}; raise max_model_len or lower max_new_tokens"))
            if v.mode == "server" and not v.server.base_urls():
                errs.append(ConfigError("custom.extra.rollout_matching.vllm.server.servers",
                                        "server mode needs at least one server: servers: [{base_url: http://127.0.0.1:8000}]"))
            if (v.mode == "colocate" and cfg.tuner.train_type == "lora" and v.sync.mode == "adapter"
                    and v.enable_lora is False):
                errs.append(ConfigError("custom.extra.rollout_matching.vllm.enable_lora",
                                        "must be true with sync.mode: adapter so the LoRA adapter syncs to the "
                                        "colocated engine; or sync.mode: full (merged weights, no LoRA kernels in "
                                        "vLLM)"))
        if v.server.async_rollouts.enabled:
            key = "custom.extra.rollout_matching.vllm.server.async_rollouts.enabled"
            if not (rm.rollout_backend == "vllm" and v.mode == "server"):
                errs.append(ConfigError(key, "asynchronous rollouts need rollout servers (rollout_backend: vllm, "
                                             f"vllm.mode: server), not {rm.rollout_backend}"
                                             f"{'/' + v.mode if rm.rollout_backend == 'vllm' else ''}; disable it"))
            if rm.rollout_buffer.enabled:
                errs.append(ConfigError(key, "not combined with rollout_buffer.enabled (M-steps decode nothing to "
                                             "overlap); disable one of them"))
        if rm.offload.enabled and not (rm.rollout_backend == "vllm" and v.mode == "colocate"):
            errs.append(ConfigError("custom.extra.rollout_matching.offload.enabled",
                                    "offload only applies to the vllm colocate backend; disable it for this backend"))
        if cfg.rlhf is not None:
            errs.append(ConfigError("rlhf", "only used by custom.trainer_variant grpo_summary; remove it"))
        if cfg.custom.extra.rollout_server is not None:
            errs.append(ConfigError("custom.extra.rollout_server",
                                    "only used by custom.trainer_variant grpo_summary (swift rollout launch); remove it"))
    elif variant == GRPO_VARIANT:
        if cfg.custom.extra.rollout_matching is not None:
            errs.append(ConfigError("custom.extra.rollout_matching", "only used by rollout_matching_sft; remove it"))
        grpo_errors, warnings = check_grpo(cfg)
        errs.extend(grpo_errors)
        for w in warnings:
            log.warning("%s", w)
    return errs


def validate_config(data: dict[str, Any], source: str = "<config>") -> TrainConfig:
    """Validate a resolved mapping; raise ``ConfigErrors`` listing every problem with its key path."""
    try:
        cfg = TrainConfig.model_validate(data)
    except pydantic.ValidationError as exc:
        raise ConfigErrors(source, errors_from_validation(exc)) from None
    errs = check_combinations(cfg)
    if errs:
        raise ConfigErrors(source, errs)
    return cfg


def load_config(path: str | Path) -> TrainConfig:
    """Resolve ``extends`` and validate; the one entry point every command uses."""
    try:
        data = resolve_yaml(path)
    except ConfigError as exc:
        raise ConfigErrors(str(path), [exc]) from None
    return validate_config(data, source=str(path))
