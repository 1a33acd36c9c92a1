"""What a ``RolloutMatchingTrainer`` runs with, as typed settings: one frozen object per concern (the rollouts, the
loss, the rows' layout, the runtime), built once from the validated config by ``stage1_settings`` /
``stage2_settings`` and passed to the trainer beside its collaborators (pipeline, engine, packing buffer, weight sync).

Invariant: the settings hold values only; anything with state (an engine, a buffer, a sync) is a separate argument.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from trainer.losses.objective import LossWeights
from trainer.memory.oom import MemorySettings
from trainer.rollout.types import DecodingParams
from trainer.sft.mismatch import DEFAULT_MISMATCH_WARN

if TYPE_CHECKING:
    from trainer.config.schema import TrainConfig

TargetSource = Literal["rollout", "ground_truth"]


@dataclass(frozen=True)
class RolloutSettings:
    """Stage 2's rollouts: how they decode and when."""

    decoding: DecodingParams = field(default_factory=DecodingParams)
    #: the HF backend decodes through the eager layers while compiled decoder layers train
    eager: bool = False
    #: ``vllm.server.async_rollouts``: the next micro-batch decodes while this one trains, at most this many optimizer
    #: steps behind the weights; None: each rollout sees the current weights
    async_max_staleness: int | None = None
    #: ``vllm.pixels_during_decode``: the training pixels are made while the engine decodes
    pixels_during_decode: bool = False
    #: ``rollout_buffer.m_steps``: each rollout batch is trained this many optimizer steps (1: no buffer)
    buffer_m_steps: int = 1
    #: ``mismatch.warn_mean_abs_diff``: warn when a logged step's mean |log p_engine - log p_learner| exceeds it; None: the
    #: engine's log-probabilities are not requested
    mismatch_warn: float | None = DEFAULT_MISMATCH_WARN

    def __post_init__(self):
        if self.buffer_m_steps < 1:
            raise ValueError(f"RolloutSettings.buffer_m_steps must be >= 1, got {self.buffer_m_steps}")
        if self.async_max_staleness is not None and self.async_max_staleness < 0:
            raise ValueError(f"RolloutSettings.async_max_staleness must be >= 0, got {self.async_max_staleness}")


@dataclass(frozen=True)
class LossSettings:
    """The objective (``rollout_matching.loss``)."""

    weights: LossWeights = field(default_factory=LossWeights)
    #: the LM head runs only at supervised positions
    supervised_logits: bool = True
    #: the supervised logits are computed this many rows at a time (``trainer.losses.chunked_objective``); None: at once
    logit_chunk_rows: int | None = None


@dataclass(frozen=True)
class LayoutSettings:
    """How a step's targets become forward rows."""

    #: padded layout: targets per micro-batch; None: all of the step's records in one
    micro_batch_rows: int | None = None
    #: packed rows' attention (``trainer.modeling.packed_attention.choose_packed_attention``); used with packing
    packed_attn_implementation: str | None = None
    #: the model's image placeholder token (a vision-language model); None: text only
    image_token_id: int | None = None
    #: ``training.host_vision_metadata``: ``image_grid_thw`` stays on the host
    host_vision_metadata: bool = True


@dataclass(frozen=True)
class RuntimeSettings:
    """Memory, offload, timing and profiling."""

    #: ``offload``: the model's and the optimizer's GPU state leave the GPU while the engine decodes
    offload_model: bool = False
    offload_optimizer: bool = False
    #: what an out-of-memory error in a step advises (``trainer.memory.oom``)
    memory: MemorySettings = field(default_factory=MemorySettings)
    #: ``training.profile_steps``: optimizer steps run under torch.profiler
    profile_steps: tuple[int, ...] = ()
    profile_trace: bool = False
    #: ``training.phase_timing``: how a row's forward is timed
    phase_timing: str = "events"

    @property
    def offload(self) -> tuple[bool, bool] | None:
        return (self.offload_model, self.offload_optimizer) if self.offload_model or self.offload_optimizer else None


@dataclass(frozen=True)
class TrainerSettings:
    """Everything a ``RolloutMatchingTrainer`` is configured by. ``target_source='rollout'``: stage 2 (an engine is
    required); ``'ground_truth'``: its warm-up (stage 1), which decodes nothing."""

    target_source: TargetSource = "rollout"
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    loss: LossSettings = field(default_factory=LossSettings)
    layout: LayoutSettings = field(default_factory=LayoutSettings)
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)

    def __post_init__(self):
        if self.target_source not in ("rollout", "ground_truth"):
            raise ValueError(f"target_source must be 'rollout' or 'ground_truth', got {self.target_source!r}")


def decoding_params(cfg: TrainConfig) -> DecodingParams:
    d = cfg.rollout_matching.decoding
    return DecodingParams(d.max_new_tokens, d.temperature, d.top_p, d.top_k, d.repetition_penalty, d.seed)


def loss_settings(cfg: TrainConfig) -> LossSettings:
    lw = cfg.rollout_matching.loss
    return LossSettings(LossWeights(lw.text_ce_weight, lw.coord_softce_weight, lw.coord_w1_weight,
                                    lw.coord_gate_weight, lw.coord_sigma),
                        supervised_logits=lw.supervised_logits_only, logit_chunk_rows=lw.logit_chunk_rows)


def stage1_settings(cfg: TrainConfig, image_token_id: int | None, packed_attn: str | None) -> TrainerSettings:
    """The warm-up: ground-truth targets, ``stage1.batch_size`` records per micro-batch, no rollouts."""
    from trainer.memory.oom import memory_settings

    return TrainerSettings(
        target_source="ground_truth",
        rollout=RolloutSettings(decoding=decoding_params(cfg), mismatch_warn=None),
        loss=loss_settings(cfg),
        layout=LayoutSettings(micro_batch_rows=cfg.stage1.batch_size, packed_attn_implementation=packed_attn,
                              image_token_id=image_token_id,
                              host_vision_metadata=cfg.training.host_vision_metadata),
        runtime=RuntimeSettings(memory=memory_settings(cfg, stage1=True), phase_timing=cfg.training.phase_timing))


def stage2_settings(cfg: TrainConfig, image_token_id: int | None, packed_attn: str | None) -> TrainerSettings:
    """Stage 2 as ``cfg`` configures it (validated: ``pixels_during_decode`` only without async rollouts)."""
    from trainer.memory.oom import memory_settings

    rm, t = cfg.rollout_matching, cfg.training
    async_rollouts = rm.vllm.server.async_rollouts
    control = rm.targets == "ground_truth"
    return TrainerSettings(
        target_source=rm.targets,
        rollout=RolloutSettings(
            decoding=decoding_params(cfg),
            eager=t.compile_decoder_layers and rm.rollout_backend == "hf" and not rm.hf.compile,
            async_max_staleness=async_rollouts.max_staleness_steps if async_rollouts.enabled else None,
            pixels_during_decode=rm.vllm.pixels_during_decode,
            buffer_m_steps=rm.rollout_buffer.m_steps if rm.rollout_buffer.enabled else 1,
            mismatch_warn=rm.mismatch.warn_mean_abs_diff if rm.mismatch.enabled and not control else None),
        loss=loss_settings(cfg),
        layout=LayoutSettings(micro_batch_rows=t.per_device_train_batch_size, packed_attn_implementation=packed_attn,
                              image_token_id=image_token_id, host_vision_metadata=t.host_vision_metadata),
        runtime=RuntimeSettings(offload_model=rm.offload.enabled and rm.offload.offload_model,
                                offload_optimizer=rm.offload.enabled and rm.offload.offload_optimizer,
                                memory=memory_settings(cfg), profile_steps=tuple(t.profile_steps),
                                profile_trace=t.profile_trace, phase_timing=t.phase_timing))
