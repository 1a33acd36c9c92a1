"""Weight-sync policy: which weights go to the rollout engine (full | adapter), and when.

Cadence (``WeightSync.ensure_fresh``), called only before fresh rollouts:
- the first call syncs the base: merged weights in ``full`` mode, the frozen base weights in ``adapter`` mode
  (covers step 0 and resume, and a base changed by a warm-up stage);
- afterwards at most one sync per ``global_step`` (optimizer-step boundary), never per micro-step;
- in a multi-process learner only the ranks the target asks for push (rank 0 for rollout servers, every
  rank for colocated engines), and a barrier follows so no rank rolls out on stale weights;
- every target brackets a sync with ``begin_sync`` / ``end_sync`` on every rank (rollout servers: the fleet pools
  the ranks' quarantines on rank 0 before, and every rank adopts rank 0's membership after; rank 0's
  ``sync_full`` / ``sync_adapter`` also re-admit answering servers with the weights built for that sync).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from trainer.sync.update_check import check_learner_weights
from trainer.sync.weights import adapter_kind, adapter_on_vision_tower, merge_lost_fraction
from trainer.telemetry import phase

log = logging.getLogger(__name__)

RequestedMode = Literal["full", "adapter", "auto"]
EffectiveMode = Literal["full", "adapter"]
#: a merged sync warns (once) when it loses more than this fraction of the LoRA update's elements
MERGE_LOST_WARN = 0.1


class SyncModeError(ValueError):
    """The requested sync mode cannot work with this model/engine combination."""


@dataclass(frozen=True)
class SyncDecision:
    mode: EffectiveMode
    reason: str


def resolve_sync_mode(requested: RequestedMode, model_adapter: str | None, engine_supports_adapter: bool,
                      fallback_to_full: bool, key: str = "custom.extra.rollout_matching.vllm.sync.mode",
                      tower_adapter: bool = False) -> SyncDecision:
    """Pick the effective mode. ``model_adapter`` is ``"lora"``, ``"dora"`` or None (see ``adapter_kind``);
    ``tower_adapter``: the adapter wraps vision-tower layers, which a served vLLM adapter never reaches."""
    if requested == "full":
        return SyncDecision("full", "requested")
    servable = model_adapter == "lora" and not tower_adapter
    if requested == "auto":
        if servable and engine_supports_adapter:
            return SyncDecision("adapter", "auto: LoRA model and the engine serves adapters")
        why = ("no LoRA adapter on the model" if model_adapter is None
               else "vLLM cannot serve DoRA adapters" if model_adapter == "dora"
               else "the adapter covers the vision tower (tuner.freeze_vit: false), which a served vLLM adapter "
                    "does not reach" if tower_adapter
               else "the engine does not serve adapters (enable_lora off)")
        return SyncDecision("full", f"auto: {why}")
    if model_adapter is None:
        raise SyncModeError(f"{key}: adapter needs a LoRA model (tuner.train_type: lora); set it to full or auto")
    if tower_adapter and model_adapter == "lora":
        if fallback_to_full:
            return SyncDecision("full", "fallback: the adapter covers the vision tower (tuner.freeze_vit: false), "
                                        "which a served vLLM adapter does not reach; merged weights sent")
        raise SyncModeError(f"{key}: adapter, but the adapter covers the vision tower (tuner.freeze_vit: false) and "
                            "vLLM applies a served adapter to the language model only; set sync.mode: full or auto, "
                            "or tuner.freeze_vit: true")
    if model_adapter == "dora":
        if fallback_to_full:
            return SyncDecision("full", "fallback: vLLM cannot serve DoRA adapters, merged weights sent")
        raise SyncModeError(f"{key}: vLLM cannot serve DoRA adapters; set sync.mode: full or sync.fallback_to_full: true")
    if not engine_supports_adapter:
        if fallback_to_full:
            return SyncDecision("full", "fallback: the engine does not serve adapters (start it with LoRA enabled)")
        raise SyncModeError(
            f"{key}: adapter, but the rollout engine does not serve LoRA adapters; start the server with LoRA "
            "enabled (swift rollout --vllm_enable_lora true / python -m trainer serve --enable-lora), "
            "or set sync.mode: full, or sync.fallback_to_full: true"
        )
    return SyncDecision("adapter", "requested")


class SyncTarget(Protocol):
    """A rollout engine that can receive weights."""

    syncs_on_every_rank: bool

    def supports_adapter_sync(self) -> bool: ...

    def begin_sync(self) -> None: ...

    def end_sync(self) -> None: ...

    def sync_full(self, model: torch.nn.Module, merge_adapter: bool = True) -> None: ...

    def sync_adapter(self, model: torch.nn.Module) -> None: ...


def _dist_info() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class WeightSync:
    """Keeps a rollout engine on the learner's current weights (see module docstring for the cadence)."""

    def __init__(self, target: SyncTarget, decision: SyncDecision):
        self.target = target
        self.decision = decision
        self.last_step: int | None = None
        self.history: list[tuple[int, str]] = []
        #: the last merged sync of a LoRA learner: the fraction of its update that rounding into the engine's 16-bit
        #: weights lost (``trainer.sync.weights.merge_lost_fraction``; ``sync/merge_lost_fraction``), until read
        self.merge_lost: float | None = None
        self._merge_warned = False

    @classmethod
    def for_model(cls, target: SyncTarget, model: torch.nn.Module, requested: RequestedMode = "full",
                  fallback_to_full: bool = True) -> WeightSync:
        decision = resolve_sync_mode(requested, adapter_kind(model), target.supports_adapter_sync(), fallback_to_full,
                                     tower_adapter=adapter_on_vision_tower(model))
        log.info("weight sync: effective mode %s (%s)", decision.mode, decision.reason)
        return cls(target, decision)

    def ensure_fresh(self, model: torch.nn.Module, global_step: int) -> bool:
        """Sync unless already synced at ``global_step``; returns whether this call synced."""
        if self.last_step == global_step:
            return False
        rank, _ = _dist_info()
        first = self.last_step is None
        self.target.begin_sync()
        try:
            with phase("sync_learner_check"):  # NaN/inf never leave the learner
                check_learner_weights(model, global_step, last_synced_step=self.last_step)
            if self.target.syncs_on_every_rank or rank == 0:
                if self.decision.mode == "full":
                    self.target.sync_full(model)
                    kind = "full"
                    self._measure_merge(model)
                else:
                    if first:
                        self.target.sync_full(model, merge_adapter=False)
                    self.target.sync_adapter(model)
                    kind = "base+adapter" if first else "adapter"
                self.history.append((global_step, kind))
        finally:
            self.target.end_sync()
        _barrier()
        self.last_step = global_step
        return True

    def _measure_merge(self, model: torch.nn.Module) -> None:
        dtype = getattr(self.target, "engine_dtype", None) or torch.bfloat16
        if dtype not in (torch.bfloat16, torch.float16):
            return
        lost = merge_lost_fraction(model, dtype)
        if lost is None:
            return
        self.merge_lost = lost
        if lost > MERGE_LOST_WARN and not self._merge_warned:
            self._merge_warned = True
            log.warning("weight sync: merging the LoRA update into the engine's %s weights rounds away %.0f%% of its "
                        "elements, so the engine decodes with less of the update than the learner trains: serve the "
                        "adapter instead (colocate: vllm.enable_lora: true; servers: --enable-lora and "
                        "vllm.sync.mode: auto) (%s)", str(dtype).removeprefix("torch."), 100 * lost,
                        self.decision.reason)

    def pop_merge_lost(self) -> float | None:
        lost, self.merge_lost = self.merge_lost, None
        return lost

    def metadata(self) -> dict[str, object]:
        return {"sync_mode": self.decision.mode, "sync_mode_reason": self.decision.reason,
                "last_synced_step": self.last_step}


def build_weight_sync(rm, engine, model: torch.nn.Module) -> WeightSync | None:
    """The weight sync for the configured backend: None for ``hf`` (it decodes with the training model),
    ``auto`` for vLLM colocate (adapter when the engine has LoRA enabled, merged weights otherwise), and
    ``vllm.sync.mode`` / ``fallback_to_full`` for rollout servers."""
    if rm.rollout_backend == "hf":
        return None
    if rm.vllm.mode == "colocate":
        return WeightSync.for_model(engine, model, "auto", fallback_to_full=True)
    return WeightSync.for_model(engine, model, rm.vllm.sync.mode, rm.vllm.sync.fallback_to_full)
