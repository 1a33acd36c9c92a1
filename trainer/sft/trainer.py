"""``RolloutMatchingTrainer``: a ``transformers.Trainer`` whose inputs are raw samples.

Per optimizer step: every record of the step (``training.records_per_step`` over the data-parallel ranks; this
rank's share arrives as HF's one micro-batch, ``gradient_accumulation_steps`` is 1 at HF's level) is decoded in one
batched engine call → strict parse → Hungarian match → one teacher-forced target per sample → the targets are packed
into as many rows as they fill (``trainer.packing.step_rows``; the carry keeps less than one row) or split into padded
micro-batches → one forward + backward per row, gradients accumulated, the loss of each divided by the step's totals
over every data-parallel rank (CE labels and coord slots, summed in one all-reduce) and multiplied by the world size
(DDP and DeepSpeed average the ranks' gradients), so the step equals one row holding every rank's segments → one
optimizer step. Data-parallel ranks agree on the row count (the largest any rank needs); a rank with fewer rows runs
zero-weight filler micro-batches so the collectives line up. The collator is the identity (the trainer needs the raw
samples) and ``remove_unused_columns`` must be false. Works with plain models, peft adapters, DDP and DeepSpeed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from trainer.buffering.rollout_buffer import RepeatingLoader, RolloutBuffer, repeated_length
from trainer.data.records import Sample
from trainer.losses.objective import LossTerms
from trainer.matching.targets import TrainTarget
from trainer.memory.offload import offload_for_rollout
from trainer.memory.oom import TrainingOutOfMemory
from trainer.memory.oom import explain as explain_out_of_memory
from trainer.modeling.adapter_casts import adapter_layers, uncast_adapter_inputs
from trainer.modeling.compile import compiled_graphs, eager_rollouts
from trainer.modeling.vision_metadata import deepstack_owner, deepstack_positions, install_host_vision_metadata
from trainer.packing.batching import pad_targets
from trainer.packing.buffer import PackingBuffer
from trainer.packing.packed_batch import pack_targets
from trainer.packing.step_rows import StepDenominators, chunk_rows, step_denominators
from trainer.packing.varlen_attention import (
    VARLEN_KERNELS,
    choose_packed_attention,
    packed_attention,
    unguarded_segment_counts,
)
from trainer.profiling import profile_region
from trainer.rollout.base import RolloutEngine
from trainer.rollout.types import DecodingParams
from trainer.sft.checkpoint_files import checkpoint_folders, rollout_state_name
from trainer.sft.forward import LOSS_KEYS, forward_loss
from trainer.sft.mismatch import MismatchStats
from trainer.sft.mismatch import summary as mismatch_summary
from trainer.sft.settings import TrainerSettings
from trainer.sft.stage2 import Stage2Pipeline
from trainer.sft.target_workers import split_prepared
from trainer.sync.update_check import NonFiniteWeightsError, check_learner_weights
from trainer.telemetry import (
    Counters,
    GcClock,
    JsonlWriter,
    PhaseTimers,
    StepClock,
    gpu_memory_snapshot,
    install_step_clock,
)

#: the disjoint phases of ``training_step`` (``time/<phase>_s``); they sum to ``time/step_s``. ``backward`` is what the
#: step spent outside the others (the backward pass and HF's bookkeeping). Sub-phases, also logged: ``generate`` and
#: ``encode`` (the chat template and the image processor on the learner's CPU, inside ``rollout``), ``parse`` /
#: ``match`` / ``build_target`` (inside ``target``); from the rollout engine and the weight sync (``telemetry.phase``):
#: ``sync_learner_check`` (the learner's own finite check), ``sync_collect`` (the weights gathered, LoRA merged),
#: ``sync_check`` (the receiver's update check; with ``sync.overlap_wake`` only its launch, and ``sync_check_wait`` the
#: read after the wake), ``sync_wake`` (the sleeping engine's weights woken), ``sync_load``
#: (the copy into the engine), and for rollout servers ``sync_wait_decodes`` (decodes in flight finishing),
#: ``sync_identity`` (which servers still hold the frozen weights) and ``sync_push``, inside ``weight_sync``; ``sleep`` and ``wake``
#: (a sleep-mode colocate engine around its decode) inside ``generate``.
STEP_PHASES = ("weight_sync", "rollout", "target", "forward", "backward")
#: after ``training_step``, outside ``time/step_s`` (``trainer.telemetry.StepClock``): ``optimizer`` (gradient
#: clipping, ``optimizer.step()``, the scheduler and ``zero_grad``, until HF's step ends) and ``step_wall`` (optimizer
#: step to optimizer step, everything included: the number to compare with another trainer's step)
AFTER_STEP_PHASES = ("optimizer", "step_wall")
#: model inputs the forward reads on the host: the vision encoder's metadata is made from the image grid there
HOST_INPUTS = ("image_grid_thw",)
LEDGER = "ledger.jsonl"
#: logged steps between two mismatch warnings
MISMATCH_WARN_EVERY = 50


def ledger_name(rank: int) -> str:
    """Rank 0 writes ``ledger.jsonl``, rank r > 0 ``ledger.rank<r>.jsonl``: together every sample each rank trained."""
    return LEDGER if rank == 0 else f"ledger.rank{rank}.jsonl"


def carried_name(rank: int) -> str:
    """Beside each rank's ledger: the samples still waiting in that rank's packing carry when ``train`` returned
    (``carried.jsonl``, ``carried.rank<r>.jsonl``); a step's records are each in exactly one rank's ledger or carry."""
    return "carried.jsonl" if rank == 0 else f"carried.rank{rank}.jsonl"


logger = logging.getLogger(__name__)


class SampleDataset(Dataset):
    """Validated samples; ``__getitem__`` returns the ``Sample`` itself. A sequence is used as is (a
    ``JsonlDataset`` parses each record when read); any other iterable is read into a list."""

    def __init__(self, samples: Sequence[Sample]):
        self.samples = samples if isinstance(samples, Sequence) else list(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Sample:
        return self.samples[i]


def identity_collator(batch: list[Sample]) -> list[Sample]:
    return list(batch)


class JsonlMetricsCallback(TrainerCallback):
    """Writes every log record (with ``step`` and ``phase``) to a JSONL file on the main process."""

    def __init__(self, path: str, phase: str):
        self.writer = JsonlWriter(path)
        self.phase = phase

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            self.writer.write({"phase": self.phase, "step": state.global_step, "time": time.time(), **logs})


class RolloutMatchingTrainer(Trainer):
    """Stage-2 rollout-matching SFT (``target_source='rollout'``) or its GT warm-up (``'ground_truth'``)."""

    def __init__(self, *args: Any, pipeline: Stage2Pipeline, engine: RolloutEngine | None,
                 settings: TrainerSettings | None = None, packing: PackingBuffer | None = None,
                 weight_sync: Any = None, **kwargs: Any):
        """``settings``: what the trainer runs with (``trainer.sft.settings``; default: stage 2 with the defaults);
        ``pipeline``, ``engine``, ``packing`` (the rows' buffer, None: padded micro-batches) and ``weight_sync``:
        its collaborators; the rest goes to ``transformers.Trainer``."""
        settings = settings if settings is not None else TrainerSettings()
        target_source, rollout, layout, runtime = (settings.target_source, settings.rollout, settings.layout,
                                                   settings.runtime)
        if target_source == "rollout" and engine is None:
            raise ValueError("a rollout engine is required for stage-2 training")
        kwargs.setdefault("data_collator", identity_collator)
        super().__init__(*args, **kwargs)
        if self.args.remove_unused_columns:
            raise ValueError("RolloutMatchingTrainer needs TrainingArguments(remove_unused_columns=False)")
        if self.accelerator.ddp_handler is not None:
            # gradients are views of DDP's all-reduce buckets: no second copy after each step's all-reduce
            # (trainer.modeling.checkpointing.resident_bytes counts what the backward still holds)
            self.accelerator.ddp_handler.gradient_as_bucket_view = True
        if self.args.gradient_accumulation_steps != 1:
            raise ValueError(
                "RolloutMatchingTrainer accumulates a step's rows itself: pass TrainingArguments("
                "gradient_accumulation_steps=1) with per_device_train_batch_size = this rank's records per optimizer "
                "step (trainer.sft.run.training_arguments folds training.gradient_accumulation_steps in)")
        #: padded layout: targets per micro-batch (default: all of the step's records in one)
        self.settings = settings
        self.micro_batch_rows = layout.micro_batch_rows or self.args.per_device_train_batch_size
        self.model_accepts_loss_kwargs = False
        self.pipeline = pipeline
        self.engine = engine
        self.decoding = rollout.decoding
        #: ``rollout_matching.mismatch``: the engine returns its log-probabilities and each logged step reports
        #: ``mismatch/*`` (``trainer.sft.mismatch``), warning above this mean |Δ log p|; None: not measured
        self.mismatch_warn = rollout.mismatch_warn if target_source == "rollout" else None
        self._mismatch = MismatchStats()
        self._mismatch_warned_at: int | None = None
        self.loss_weights = settings.loss.weights
        self.target_source = target_source
        self.image_token_id = layout.image_token_id
        self.packing = packing
        self.offload = runtime.offload
        self.weight_sync = weight_sync
        self.supervised_logits = settings.loss.supervised_logits
        self.logit_chunk_rows = settings.loss.logit_chunk_rows  # ``loss.logit_chunk_rows`` (``trainer.losses.chunked_objective``)
        #: ``training.phase_timing``: how a row's forward is timed (``PhaseTimers.phase``'s ``device_time``, which
        #: validates it)
        self.phase_timing = runtime.phase_timing
        #: ``training.host_vision_metadata``: ``image_grid_thw`` stays on the host and the vision encoder's metadata is
        #: made there (``trainer.modeling.vision_metadata``)
        self.host_grid = layout.host_vision_metadata and install_host_vision_metadata(self.model)
        self._deepstack_owner = deepstack_owner(self.model) if self.host_grid else None
        self.eager_rollouts = rollout.eager
        #: ``vllm.pixels_during_decode``: the training pixels are made on ``_pixel_pool``'s thread while the engine decodes
        self.pixels_during_decode = rollout.pixels_during_decode and self._can_defer_pixels(engine, pipeline)
        self._pixel_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._layout_stack: contextlib.ExitStack | None = None
        #: what an out-of-memory error in a step advises (``trainer.memory.oom``)
        self.memory_settings = runtime.memory
        #: ``training.profile_steps``: optimizer steps whose weight sync and rows (forward + backward) run under
        #: torch.profiler
        self.profile_steps = set(runtime.profile_steps)
        self.profile_trace = runtime.profile_trace
        self._sync_profiled: set[int] = set()
        self._adapter_layers: list[torch.nn.Module] | None = None  # peft tuner layers, found at the first forward
        self._resume_skip = 0
        self._steps_per_epoch = 1
        self.packed_attn = (choose_packed_attention(layout.packed_attn_implementation,
                                                    layout.image_token_id is not None)
                            if packing is not None else None)
        self.rollout_buffer = (RolloutBuffer(self.args.gradient_accumulation_steps, rollout.buffer_m_steps)
                               if rollout.buffer_m_steps > 1 else None)
        self.coord_ids = torch.tensor(sorted(pipeline.coord_bin_by_id, key=pipeline.coord_bin_by_id.get))
        self._coord_ids_device: torch.Tensor | None = None
        self.timers = PhaseTimers()
        #: ``compile/new_graphs``: graphs Dynamo compiled since the previous logged step (a rise after the first
        #: steps is a recompile), counted from what was compiled before training
        self._graphs_logged = compiled_graphs()
        #: ``compile/recompiles_after_first_step``: graphs Dynamo compiled after this process's first optimizer step
        #: (counted from the start of its second ``training_step``), summed over the ranks; 0 when no pack layout
        #: recompiles the layers
        self._graphs_after_first_step: int | None = None
        self._steps_run = 0
        self.counters = Counters()
        self._loss_terms: list[LossTerms] = []  # per optimizer step; read to the host when logged
        self._max_staleness = 0
        #: ``async_rollouts``: the next micro-batch is decoded while this one trains (``trainer.rollout.prefetch``)
        self.prefetcher = None
        if rollout.async_max_staleness is not None and target_source == "rollout":
            from trainer.rollout.prefetch import RolloutPrefetcher

            if not hasattr(engine, "generate_async"):
                raise ValueError("async_rollouts needs a rollout-server engine (generate_async)")
            self.prefetcher = RolloutPrefetcher(engine, rollout.async_max_staleness)
        self._lookahead: tuple[Any, Any] | None = None  # (epoch iterator, the micro-batch read ahead of it)
        self._plan: list[tuple[int, list[Sample]]] = []  # micro-batches still to come, with their optimizer step
        self._staleness: list[int] = []
        self._background_codec: Stage2Pipeline | None = None  # the pipeline's copy that encodes batches issued ahead
        #: optional timeline for benchmarks: (kind, start, end) with kind "wait" (learner waits on rollouts), "sync"
        #: (weight push, inside a step) or "step"
        self.timeline: list[tuple[str, float, float]] | None = None
        self.step_clock = StepClock()
        install_step_clock(self, self.step_clock, self._record_after_step)
        #: ``gc/pause_s`` per logged step: Python's collector pauses, wherever they fell (a long-lived engine heap
        #: beside the learner makes full collections expensive)
        self.gc_clock = GcClock()

    @staticmethod
    def _can_defer_pixels(engine: Any, pipeline: Stage2Pipeline) -> bool:
        encoder = pipeline.encoder
        if not (getattr(engine, "reads_images", False) and encoder.multimodal and encoder.can_defer_pixels):
            logger.warning("vllm.pixels_during_decode: the pixels are made before the decode (engine %s reads "
                           "pixel values, or the image processor %s cannot give an image's grid from its size)",
                           getattr(engine, "name", engine), type(encoder.image_processor).__name__)
            return False
        return True

    def _encode_for_decode(self, samples: Sequence[Sample]) -> tuple[list[Any], concurrent.futures.Future | None]:
        """The step's requests for the decode; with ``pixels_during_decode`` without their pixel values, which a
        worker thread adds meanwhile (the future's result: the requests with them)."""
        if not self.pixels_during_decode:
            return self.pipeline.requests(samples)[0], None
        requests = self.pipeline.requests(samples, pixels=False)[0]
        if self._pixel_pool is None:
            self._pixel_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rm-pixels")
        return requests, self._pixel_pool.submit(self._pixels_timed, samples, requests)

    def _pixels_timed(self, samples: Sequence[Sample], requests: list[Any]) -> tuple[list[Any], float]:
        """The pixel thread's work and its own wall seconds (``time/pixels_during_decode_s``: how much of the
        decode it overlapped, where ``encode``'s share after the decode is what it did not)."""
        t0 = time.perf_counter()
        out = self.pipeline.with_pixels(samples, requests)
        return out, time.perf_counter() - t0

    def rollout_params(self, step: int | None = None) -> DecodingParams:
        """Decoding params for this optimizer step (sampling seed advances with the step)."""
        d = self.decoding
        step = self.state.global_step if step is None else step
        seed = None if d.seed is None else d.seed + step
        logprobs = 0 if self.mismatch_warn is not None else d.logprobs
        return DecodingParams(d.max_new_tokens, d.temperature, d.top_p, d.top_k, d.repetition_penalty, seed, logprobs)

    def make_targets(self, samples: Sequence[Sample]) -> list[TrainTarget]:
        """The step's training targets; the engine and the weight sync record their sub-phases (``sync_collect``,
        ``sync_check``, ``sync_wake``, ``sync_load``, ``sleep``, ...) into this step's timers."""
        if self.target_source == "ground_truth":
            with self.timers.phase("target"):
                return self.pipeline.ground_truth_targets(samples)
        with self.timers.bound():
            return self._rollout_targets(samples)

    def _rollout_targets(self, samples: Sequence[Sample]) -> list[TrainTarget]:
        step = self.state.global_step
        prefetched = requests = upcoming = finished = None
        if self.prefetcher is not None:
            upcoming = self._next_planned(samples)
            with self.timers.phase("rollout"), self.timers.phase("generate"), self._timeline("wait"):
                prefetched = self.prefetcher.take([s.sample_id for s in samples], self.rollout_params(), step)
            if prefetched is not None:
                requests = prefetched[2]  # encoded in the background with the decode (None after a resume)
                finished = prefetched[3]  # (targets, their timers), built in the background after the decode
        if self.weight_sync is not None:
            profiled = contextlib.nullcontext()
            if step + 1 in self.profile_steps and step + 1 not in self._sync_profiled and self.is_world_process_zero():
                self._sync_profiled.add(step + 1)
                profiled = profile_region(Path(self.args.output_dir) / "profile", step + 1, self.profile_trace,
                                          region="weight_sync")
            with self.timers.phase("weight_sync"), self._timeline("sync"), profiled:
                if self.weight_sync.ensure_fresh(self.accelerator.unwrap_model(self.model), step):
                    self.counters.add({"weight_syncs": 1})
                    lost = getattr(self.weight_sync, "pop_merge_lost", lambda: None)()
                    if lost is not None:
                        self.counters.add({"merge_lost_sum": lost, "merge_lost_syncs": 1})
        with self.timers.phase("rollout"):
            if prefetched is not None:
                results, version = prefetched[0], prefetched[1]
            pending = None
            if requests is None:
                with self.timers.phase("encode"):
                    requests, pending = self._encode_for_decode(samples)
            if prefetched is None:
                offload = (offload_for_rollout(self.model_wrapped, self.optimizer, *self.offload) if self.offload
                           else contextlib.nullcontext(None))
                with self.timers.phase("generate"), self._timeline("wait"), offload as moved, \
                        eager_rollouts(self.eager_rollouts):
                    results = self.engine.generate(requests, self.rollout_params())
                version = step
                if moved is not None:
                    self.counters.add({"offload_param_bytes": moved.moved_param_bytes,
                                       "offload_optimizer_bytes": moved.moved_optimizer_bytes})
            if pending is not None:  # what is left of making the pixels after the decode
                with self.timers.phase("encode"):
                    requests, pixel_s = pending.result()
                self.timers.seconds["pixels_during_decode"] += pixel_s
            if self.prefetcher is not None and upcoming is not None:
                # the servers decode the next step's batch, on the weights just synced, while this one trains; its
                # chat template and image processing run in the engine's background thread first
                synced = self.weight_sync.last_step if self.weight_sync is not None else step
                next_step, batch = upcoming
                self._issue_ahead(batch, next_step, synced if synced is not None else step)
        with self.timers.phase("target"):  # sub-phases parse / match / build_target
            if finished is not None:
                targets, ahead = finished
                self.timers.seconds["target_ahead"] += ahead.seconds.get("target_ahead", 0.0)
            else:
                targets = self.pipeline.targets(samples, requests, results, self.timers)
        self.counters.add({"samples": len(samples)})
        self._staleness.extend([step - version] * len(samples))
        for t in targets:
            t.stats["rollout_step"] = step
            t.stats["decode_step"] = version
            self.counters.add({k: v for k, v in t.stats.items() if k not in ("rollout_step", "decode_step")})
        return targets

    def _issue_ahead(self, batch: list[Sample], step: int, version: int) -> None:
        """Prefetch ``batch`` (optimizer step ``step``) on the weights of ``version``. Its requests are built in the
        engine's background thread by a private copy of the pipeline (a fast tokenizer must not be used by two
        threads at once) when the engine can (``generate_async_built``), and its targets by the same copy on the
        prefetcher's thread once the decode is back (``time/target_ahead_s``, off the step's critical path); else
        the requests here and the targets at the batch's turn."""
        params = self.rollout_params(step)
        if not hasattr(self.engine, "generate_async_built"):
            with self.timers.phase("encode"):
                requests = self.pipeline.requests(batch)[0]
            self.prefetcher.issue(requests, params, version, step)
            return
        if self._background_codec is None:
            self._background_codec = copy.deepcopy(self.pipeline)
        codec = self._background_codec

        def targets(requests, results):
            timers = PhaseTimers.time_only()
            with timers.phase("target_ahead"):
                return codec.targets(batch, requests, results, timers), timers

        self.prefetcher.issue(lambda: codec.requests(batch)[0], params, version, step,
                              sample_ids=[s.sample_id for s in batch], finish=targets)

    @contextlib.contextmanager
    def _timeline(self, kind: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.timeline is not None:
                self.timeline.append((kind, start, time.perf_counter()))

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """HF's per-optimizer-step fetch; with ``async_rollouts`` one micro-batch more is read ahead (kept for the
        next call on the same iterator), so the next batch is known while this step trains. The order of batches
        is the dataloader's, unchanged."""
        if self.prefetcher is None or self.target_source != "rollout":
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        batches = []
        if self._lookahead is not None and self._lookahead[0] is epoch_iterator and num_batches > 0:
            batches.append(self._lookahead[1])
        self._lookahead = None
        while len(batches) < num_batches:
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        ahead = None
        if len(batches) == num_batches:
            try:
                ahead = next(epoch_iterator)
                self._lookahead = (epoch_iterator, ahead)
            except StopIteration:
                pass
        step = self.state.global_step
        self._plan = [(step, b) for b in batches] + ([(step + 1, ahead)] if ahead is not None else [])
        return batches, self._get_num_items_in_batch(batches, device)

    def _next_planned(self, samples: list[Sample]) -> tuple[int, list[Sample]] | None:
        """Advance the plan past ``samples``; the micro-batch after it (with its optimizer step), if known."""
        ids = [s.sample_id for s in samples]
        while self._plan:
            _, batch = self._plan.pop(0)
            if isinstance(batch, list) and [s.sample_id for s in batch] == ids:
                break
        else:
            return None
        nxt = self._plan[0] if self._plan else None
        return nxt if nxt is not None and isinstance(nxt[1], list) else None

    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        if self.rollout_buffer is not None:
            skip, self._resume_skip = self._resume_skip, 0
            loader = RepeatingLoader(loader, self.rollout_buffer.window, self.rollout_buffer.m_steps, skip)
        self._steps_per_epoch = max(len(loader) // self.args.gradient_accumulation_steps, 1)
        return loader

    def _step_micro_batches(self, samples: list[Sample]) -> list[dict[str, Any]]:
        """This rank's micro-batches for the optimizer step of ``samples`` (fresh, or replayed by the rollout
        buffer's M-steps); records the data loader's workers prepared (``trainer.sft.target_workers``) come with their
        targets."""
        samples, targets = split_prepared(samples)
        if targets is not None:
            return self._build_batch(samples, targets)
        if self.rollout_buffer is not None:
            prepared, fresh, staleness = self.rollout_buffer.prepare(
                [s.sample_id for s in samples], lambda: self._build_batch(samples))
            self.counters.add({"buffer_fresh": int(fresh), "buffer_replay": int(not fresh)})
            self._max_staleness = max(self._max_staleness, staleness)
            return prepared
        return self._build_batch(samples)

    def _rows_agreed(self, local: int) -> int:
        """The largest row count any data-parallel rank needs this step (``local`` without torch.distributed). The
        all-reduce is where a rank that finished its rollouts first waits for the slowest: ``time/rows_agree_s``, a
        sub-phase of ``target``."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return local
        with self.timers.phase("rows_agree"):
            count = torch.tensor([local], device=self.args.device, dtype=torch.long)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            return int(count.item())

    def _step_totals(self, ce: int, coord: int) -> tuple[StepDenominators, float]:
        """The step's CE label and coord slot counts over every data-parallel rank (this rank's ``ce`` and ``coord``
        summed in one all-reduce, before any backward) and the weight of this rank's rows: the data-parallel world
        size, since DDP and DeepSpeed average the ranks' gradients (HF's ``average_tokens_across_devices``). The
        step's gradient is then that of one row holding every rank's segments. Without torch.distributed: this rank's
        counts and 1. Timed in ``time/rows_agree_s``."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return step_denominators([ce], [coord]), 1.0
        with self.timers.phase("rows_agree"):
            counts = torch.tensor([ce, coord], device=self.args.device, dtype=torch.long)
            dist.all_reduce(counts, op=dist.ReduceOp.SUM)
            ce, coord = counts.tolist()
        return step_denominators([ce], [coord]), float(dist.get_world_size())

    def _build_batch(self, samples: list[Sample], targets: list[TrainTarget] | None = None) -> list[dict[str, Any]]:
        """Rollout → targets (or the ``targets`` given) → packed rows (or padded micro-batches), each with the step's
        loss denominators; what an E-step caches."""
        if targets is None:
            targets = self.make_targets(samples)
        with self.timers.phase("target"):  # packing / padding the targets into the step's rows
            if self.packing is None:
                groups = [[targets[i] for i in c] for c in chunk_rows(len(targets), self.micro_batch_rows)]
                rows = self._rows_agreed(len(groups))
                batches = [pad_targets(g, self.pipeline.tokenizer.pad_token_id, self.image_token_id) for g in groups]
                self.counters.add({"rows": len(batches), "padded_steps": 1,
                                   "tokens_real": sum(int(b["attention_mask"].sum()) for b in batches),
                                   "tokens_padded": sum(int(b["input_ids"].numel()) for b in batches)})
            else:
                self.packing.add(targets)
                rows = self._rows_agreed(self.packing.rows_needed())
                groups, stats = self.packing.pop_rows(rows)
                unwrapped = self.accelerator.unwrap_model(self.model)
                batches = [pack_targets(g, self.packed_attn, unwrapped, self.image_token_id) for g in groups]
                self.counters.add({"rows": len(batches), "tokens_real": stats.tokens, "tokens_padded": stats.capacity,
                                   "packed_segments": stats.segments, "packing_carried": stats.carried,
                                   "packing_steps": 1})
            den, weight = self._step_totals(sum(int(b["ce_labels"].numel()) for b in batches),
                                            sum(int(b["coord_targets"].numel()) for b in batches))
            for group, batch in zip(groups, batches):
                batch["sample_ids"] = [t.sample_id for t in group]
                batch["rollout_steps"] = [t.stats.get("rollout_step", -1) for t in group]
                batch["decode_steps"] = [t.stats.get("decode_step", t.stats.get("rollout_step", -1)) for t in group]
                batch["loss_ce_denominator"] = den.ce
                batch["loss_coord_denominator"] = den.coord
                batch["loss_weight"] = weight
            fillers = [{**batches[-1], "loss_weight": 0.0, "sample_ids": [], "rollout_steps": [], "decode_steps": []}
                       for _ in range(rows - len(batches))]
            if fillers:
                self.counters.add({"filler_rows": len(fillers)})
        return batches + fillers

    def _coord_ids_on(self, device: torch.device) -> torch.Tensor:
        """``coord_ids`` on ``device``, copied once (a copy per row from pageable memory waits for the GPU)."""
        if self._coord_ids_device is None or self._coord_ids_device.device != device:
            self._coord_ids_device = self.coord_ids.to(device)
        return self._coord_ids_device

    def _prepare_input(self, data):
        """HF's move to the device, from page-locked memory without waiting on a GPU (a pageable copy first waits for
        everything queued, the previous row's backward included)."""
        if isinstance(data, torch.Tensor) and data.device.type == "cpu" and self.args.device.type == "cuda":
            kwargs: dict[str, Any] = {"device": self.args.device, "non_blocking": True}
            if self.is_deepspeed_enabled and (torch.is_floating_point(data) or torch.is_complex(data)):
                kwargs["dtype"] = self.accelerator.state.deepspeed_plugin.hf_ds_config.dtype()
            return data.pin_memory().to(**kwargs)
        return super()._prepare_input(data)

    def _prepare_inputs(self, inputs):
        """HF's, with the inputs read on the host left there (``HOST_INPUTS`` when ``host_grid``, in batches that
        carry their own ``position_ids``: without them the model derives the mRoPE positions from the grid itself),
        and the loss inputs (``LOSS_KEYS``: coord targets, engine log-probabilities, indices) moved in their own
        dtype: under DeepSpeed HF casts every float input to the engine's 16-bit dtype, where bf16 would move coord
        bins above 256 by up to 2."""
        if not isinstance(inputs, dict):
            return super()._prepare_inputs(inputs)
        kept = ({k: inputs[k] for k in HOST_INPUTS if k in inputs} if self.host_grid and "position_ids" in inputs
                else {})
        exact = {k: v for k, v in inputs.items() if k in LOSS_KEYS and isinstance(v, torch.Tensor) and k not in kept}
        prepared = super()._prepare_inputs({k: v for k, v in inputs.items() if k not in kept and k not in exact})
        device = self.args.device
        moved = {k: (v.pin_memory().to(device, non_blocking=True) if v.device.type == "cpu" and device.type == "cuda"
                     else v.to(device)) for k, v in exact.items()}
        return {**prepared, **moved, **kept}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        unwrapped = self.accelerator.unwrap_model(model)
        if self._layout_stack is not None and self.accelerator.native_amp:
            # the forward runs under bf16/fp16 autocast: peft's float32 input casts are pure copies there
            if self._adapter_layers is None:
                self._adapter_layers = adapter_layers(unwrapped)
            if self._adapter_layers:
                self._layout_stack.enter_context(uncast_adapter_inputs(self._adapter_layers))
        layout = contextlib.nullcontext()
        if self.packed_attn is not None and "position_ids" in inputs:
            if self.packed_attn in VARLEN_KERNELS.values():
                unguarded_segment_counts(inputs.get("cu_seq_lens_q"), inputs.get("cu_seq_lens_k"))
            layout = packed_attention(unwrapped, self.packed_attn, inputs.get("packed_cu_seq_lens"),
                                      inputs.get("packed_max_length"))
            if self._layout_stack is not None:
                self._layout_stack.enter_context(layout)
                layout = contextlib.nullcontext()
        positions = deepstack_positions(self._deepstack_owner, inputs.get("image_positions"))
        with self.timers.phase("forward", device_time=self.phase_timing), layout, positions:
            loss, terms, outputs = forward_loss(model, inputs, self._coord_ids_on(self.args.device), self.loss_weights,
                                                self.supervised_logits, unwrapped, self.logit_chunk_rows,
                                                self._mismatch if self.mismatch_warn is not None else None,
                                                0.0 if self.decoding.greedy else self.decoding.temperature)
        self._loss_terms.append(terms)
        self._record_ledger(inputs.get("sample_ids"), inputs.get("rollout_steps"), inputs.get("decode_steps"))
        return (loss, outputs) if return_outputs else loss

    def _record_ledger(self, sample_ids: list[str] | None, rollout_steps: list[int] | None,
                       decode_steps: list[int] | None = None) -> None:
        """Append ``(epoch, sample_id, step, rollout_step, decode_step)`` per sample trained in this forward to this
        rank's ledger (``ledger_name``); ``rollout_step`` is the optimizer step whose rollout produced the target
        (older when carried/replayed), ``decode_step`` the optimizer step of the weights it was decoded with (older than
        ``rollout_step`` only with ``async_rollouts``)."""
        if not sample_ids:
            return
        epoch = self.state.global_step // self._steps_per_epoch
        rollout_steps = rollout_steps or [-1] * len(sample_ids)
        with open(os.path.join(self.args.output_dir, ledger_name(self.args.process_index)), "a", encoding="utf-8") as fh:
            for sid, rstep, dstep in zip(sample_ids, rollout_steps, decode_steps or rollout_steps):
                fh.write(json.dumps({"epoch": epoch, "sample_id": sid, "step": self.state.global_step,
                                     "rollout_step": rstep, "decode_step": dstep}) + "\n")

    def rollout_state(self) -> dict[str, Any]:
        """What a checkpoint needs beyond HF's state for an exact resume (rank-local)."""
        buf = self.rollout_buffer
        return {
            "packing": list(self.packing.segments) if self.packing is not None else None,
            "rollout_buffer": None if buf is None else {"micro_step": buf.micro_step, "cache": buf.cache},
            # async_rollouts: the rollout in flight, finished (a resume trains exactly what this run would have)
            "prefetch": None if self.prefetcher is None else self.prefetcher.state(),
        }

    def load_rollout_state(self, state: dict[str, Any]) -> None:
        if self.packing is not None:
            self.packing.segments = list(state["packing"] or [])
        if self.rollout_buffer is not None and state["rollout_buffer"] is not None:
            self.rollout_buffer.micro_step = state["rollout_buffer"]["micro_step"]
            self.rollout_buffer.cache = state["rollout_buffer"]["cache"]
        if self.prefetcher is not None:
            self.prefetcher.load_state(state.get("prefetch"))

    def _save_checkpoint(self, model, trial) -> None:
        # never a checkpoint of non-finite weights: the last good one stays the newest complete checkpoint
        check_learner_weights(self.accelerator.unwrap_model(self.model), self.state.global_step)
        super()._save_checkpoint(model, trial)
        folder = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        path = os.path.join(folder, rollout_state_name(self.args.process_index))
        torch.save(self.rollout_state(), path + ".tmp")
        os.replace(path + ".tmp", path)

    def latest_complete_checkpoint(self) -> str | None:
        """Newest ``checkpoint-*`` whose rollout state (written last, atomically) exists for this rank: a process
        killed while saving leaves an incomplete folder, which is skipped with a warning."""
        for folder in checkpoint_folders(self.args.output_dir):
            if (folder / rollout_state_name(self.args.process_index)).is_file():
                return str(folder)
            logger.warning("skipping %s: incomplete (no %s; the run was stopped while saving it)", folder,
                           rollout_state_name(self.args.process_index))
        return None

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any):
        """``resume_from_checkpoint``: a checkpoint folder, or True / "latest" for the newest complete one in
        ``output_dir``."""
        if resume_from_checkpoint in (True, "latest"):
            resume_from_checkpoint = self.latest_complete_checkpoint()
            if resume_from_checkpoint is None:
                raise FileNotFoundError(f"no complete checkpoint-* folder in {self.args.output_dir} to resume from")
        if resume_from_checkpoint:
            path = os.path.join(resume_from_checkpoint, rollout_state_name(self.args.process_index))
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} is missing: this checkpoint cannot be resumed exactly "
                                        "(it was not written by RolloutMatchingTrainer)")
            self.load_rollout_state(torch.load(path, weights_only=False))
            with open(os.path.join(resume_from_checkpoint, "trainer_state.json"), encoding="utf-8") as fh:
                step = json.load(fh)["global_step"]
            self._truncate_ledger(step)
            if self.rollout_buffer is not None:
                self._skip_repeated_batches(step)
        self.gc_clock.open()
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        except NonFiniteWeightsError as exc:  # stop the run, naming the last good checkpoint
            raise exc.with_checkpoint(self.latest_complete_checkpoint()) from None
        except TrainingOutOfMemory as exc:
            raise exc.with_checkpoint(self.latest_complete_checkpoint()) from exc.__cause__
        finally:
            if self.prefetcher is not None:  # a batch read ahead past max_steps is never trained
                self.prefetcher.discard()
            self._lookahead, self._plan = None, []
            if self._pixel_pool is not None:
                self._pixel_pool.shutdown(wait=True)
                self._pixel_pool = None
            self.gc_clock.close()
            self._write_carried()

    def _write_carried(self) -> None:
        """This rank's packing carry (``carried_name``): one ``{"sample_id", "rollout_step"}`` line per segment not
        trained when the run stopped (a resume trains them from the checkpoint's rollout state)."""
        if self.packing is None:
            return
        os.makedirs(self.args.output_dir, exist_ok=True)
        with open(os.path.join(self.args.output_dir, carried_name(self.args.process_index)), "w",
                  encoding="utf-8") as fh:
            for t in self.packing.segments:
                fh.write(json.dumps({"sample_id": t.sample_id,
                                     "rollout_step": t.stats.get("rollout_step", -1)}) + "\n")

    def _skip_repeated_batches(self, step: int) -> None:
        """HF's resume skips batches of the raw loader, not of the window repeater: skip in the repeater instead."""
        ga = self.args.gradient_accumulation_steps
        repeated = repeated_length(len(super().get_train_dataloader()), ga, self.rollout_buffer.m_steps)
        steps_per_epoch = max(repeated // ga, 1)
        self._resume_skip = (step % steps_per_epoch) * ga
        self.args.ignore_data_skip = True

    def _truncate_ledger(self, step: int) -> None:
        """Drop ledger rows written after the checkpoint (they will be trained again)."""
        path = os.path.join(self.args.output_dir, ledger_name(self.args.process_index))
        if not os.path.isfile(path):
            return
        with open(path, encoding="utf-8") as fh:
            rows = [line for line in fh if line.strip() and json.loads(line)["step"] < step]
        with open(path, "w", encoding="utf-8") as fh:
            fh.writelines(rows)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """One optimizer step's forward + backward passes: ``inputs`` is this rank's records of the step (HF's one
        micro-batch); the rows they fill are accumulated, gradients synchronised on the last."""
        start = time.perf_counter()
        self._steps_run += 1
        if self._steps_run == 2:
            self._graphs_after_first_step = compiled_graphs()
        before = dict(self.timers.seconds)
        terms_before = len(self._loss_terms)
        total = None
        self.timers.out_of_memory_in = None
        self.timers.discard_pending()
        try:
            with self.timers.track_peak("step"), contextlib.ExitStack() as profiled:
                micro_batches = self._step_micro_batches(inputs) if isinstance(inputs, list) else [inputs]
                step = self.state.global_step + 1
                if step in self.profile_steps and self.is_world_process_zero():
                    self.profile_steps.discard(step)  # every row's forward + backward, the rollout before them not
                    profiled.enter_context(profile_region(Path(self.args.output_dir) / "profile", step,
                                                          self.profile_trace, rows=len(micro_batches)))
                for i, batch in enumerate(micro_batches):
                    with self._accumulating(model, last=i == len(micro_batches) - 1), \
                            contextlib.ExitStack() as stack:
                        # the packed attention layout entered by compute_loss stays on through backward: activation
                        # checkpointing recomputes the forward there and must see the same segment-isolating attention
                        self._layout_stack = stack
                        try:
                            loss = super().training_step(model, batch, num_items_in_batch)
                        finally:
                            self._layout_stack = None
                    total = loss if total is None else total + loss
                self.timers.record_peak("backward")  # since the last forward ended: backward + bookkeeping
                self.timers.settle()  # the step's one wait for the device: its backward is in time/step_s
        except torch.OutOfMemoryError as exc:
            if isinstance(exc, TrainingOutOfMemory):
                raise
            raise self._explain_oom(exc, self.timers.out_of_memory_in) from exc
        self._merge_step_terms(terms_before)
        spent = time.perf_counter() - start
        measured = sum(self.timers.seconds.get(k, 0.0) - before.get(k, 0.0) for k in STEP_PHASES[:-1])
        self.timers.seconds["backward"] += max(0.0, spent - measured)
        self.timers.seconds["step"] += spent
        self.step_clock.training_step_end()
        if self.timeline is not None:
            self.timeline.append(("step", start, start + spent))
        return total

    def _record_after_step(self, optimizer_s: float | None, step_wall_s: float | None) -> None:
        for name, seconds in zip(AFTER_STEP_PHASES, (optimizer_s, step_wall_s)):
            if seconds is not None:
                self.timers.seconds[name] += seconds

    def create_optimizer(self, model=None):
        """HF's optimizer, its ``step`` timed under its own peak (``mem/optimizer_peak_gib``) and an out-of-memory
        error inside it explained as the steps' are (phase ``optimizer``: AdamW's first step allocates its states)."""
        optimizer = super().create_optimizer(model) if model is not None else super().create_optimizer()
        if getattr(optimizer.step, "_rm_explained", False):
            return optimizer
        inner = optimizer.step

        def step(*args, **kwargs):
            self.timers.out_of_memory_in = None
            try:
                with self.timers.track_peak("optimizer"):
                    return inner(*args, **kwargs)
            except torch.OutOfMemoryError as exc:
                if isinstance(exc, TrainingOutOfMemory):
                    raise
                raise self._explain_oom(exc, "optimizer") from exc

        step._rm_explained = True
        optimizer.step = step
        return optimizer

    def _explain_oom(self, exc: BaseException, phase: str | None) -> TrainingOutOfMemory:
        device_gib = (torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
                      if torch.cuda.is_available() else None)
        return explain_out_of_memory(exc, phase, self.state.global_step + 1, self.memory_settings,
                                     {k: v / 2**30 for k, v in self.timers.peak_bytes.items()}, device_gib)

    @contextlib.contextmanager
    def _accumulating(self, model, last: bool):
        """Gradients of a micro-batch that is not the step's last stay local: DDP's ``no_sync`` and accelerate's
        ``sync_gradients`` off (DeepSpeed then neither crosses its accumulation boundary nor steps)."""
        if last:
            yield
            return
        from accelerate.utils import DistributedType

        state = self.accelerator.gradient_state
        state._set_sync_gradients(False)
        try:
            if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
                yield
            else:
                with self.accelerator.no_sync(model):
                    yield
        finally:
            state._set_sync_gradients(True)

    def _merge_step_terms(self, first: int) -> None:
        """One entry of loss terms per optimizer step: the micro-batches' shares summed (each was divided by the
        step's totals, so the sums are the step's means)."""
        parts = self._loss_terms[first:]
        if len(parts) > 1:
            del self._loss_terms[first:]
            self._loss_terms.append({k: sum(p.get(k, 0.0) for p in parts) for k in parts[0]})

    def _sum_over_ranks(self, values: Sequence[Any]) -> list[float]:
        """``values`` (numbers, 0-d tensors) summed over the data-parallel ranks in one all-reduce (every rank logs the
        same keys at the same steps); as they are without torch.distributed."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return [float(v) for v in values]
        summed = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.args.device)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        return summed.tolist()

    def _pop_mismatch(self) -> dict[str, float]:
        """The ``mismatch/*`` values since the last logged step over every data-parallel rank (sums all-reduced, the
        max taken over ranks); a warning when the mean exceeds ``mismatch_warn``."""
        import torch.distributed as dist

        abs_sum, abs_max, k3_sum, tokens = self._mismatch.totals()
        self._mismatch = MismatchStats()
        abs_sum, k3_sum, tokens = self._sum_over_ranks([abs_sum, k3_sum, tokens])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            top = torch.tensor([abs_max], dtype=torch.float64, device=self.args.device)
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
            abs_max = float(top.item())
        out = mismatch_summary(abs_sum, abs_max, k3_sum, tokens)
        mean = out.get("mismatch/logp_abs_diff_mean", 0.0)
        step = self.state.global_step
        if mean > self.mismatch_warn and self.is_world_process_zero() and (
                self._mismatch_warned_at is None or step - self._mismatch_warned_at >= MISMATCH_WARN_EVERY):
            self._mismatch_warned_at = step
            logger.warning(
                "step %d: the rollout engine's log-probabilities differ from the learner's by %.3f nats a token on "
                "average (max %.3f; threshold rollout_matching.mismatch.warn_mean_abs_diff = %.3f): the engine is not "
                "decoding with the policy being trained. Check that the weight sync ran (sync/weight_syncs), that a "
                "LoRA adapter reaches the engine (vllm.sync.mode), and the engine dtype (docs: reference/metrics, "
                "mismatch/*)", step, mean, out["mismatch/logp_abs_diff_max"], self.mismatch_warn)
        return out

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """HF's log record, with the step's loss terms (``loss/*``: the means over every rank's tokens, as ``loss``
        is; ``tokens/*``: every rank's counts), ``compile/recompiles_after_first_step`` (every rank's) and this rank's
        timers, peaks, rollout and batch counts."""
        if "loss" in logs and self._loss_terms:
            n = len(self._loss_terms)
            keys = sorted(self._loss_terms[0])
            graphs = compiled_graphs()
            first = self._graphs_after_first_step
            sums = self._sum_over_ranks([sum(t[key] for t in self._loss_terms) for key in keys]
                                        + [graphs, 0 if first is None else graphs - first])
            for key, value in zip(keys, sums):
                logs[key] = value if key.startswith("tokens/") else value / n
            self._loss_terms.clear()
            for name, sec in self.timers.pop().items():
                logs[f"time/{name}_s"] = sec
            for name, nbytes in self.timers.pop_peaks().items():
                logs[f"mem/{name}_peak_gib"] = nbytes / 2**30
            c = self.counters.pop()
            if c.get("samples"):
                for key in ("matched", "fn_appended", "fp", "gated", "gt", "valid_pred", "invalid_pred",
                            "truncated", "broken", "excluded_alignment", "prefix_dropped", "samples"):
                    logs[f"rollout/{key}"] = c.get(key, 0.0)
                predicted = c.get("valid_pred", 0.0) + c.get("invalid_pred", 0.0)
                logs["rollout/valid_object_rate"] = c.get("valid_pred", 0.0) / predicted if predicted else 0.0
                logs["rollout/match_recall"] = c.get("matched", 0.0) / c["gt"] if c.get("gt") else 0.0
                logs["rollout/junction_fused_rate"] = c.get("junction_fused", 0.0) / c["samples"]
            if c.get("tokens_padded"):
                logs["batch/fill"] = c["tokens_real"] / c["tokens_padded"]
                logs["batch/tokens"] = c["tokens_real"]
            if self._staleness:
                logs["rollout/staleness_max"] = float(max(self._staleness))
                logs["rollout/staleness_mean"] = sum(self._staleness) / len(self._staleness)
                self._staleness = []
            if self.prefetcher is not None:
                for key, value in self.prefetcher.pop_stats().items():
                    logs[f"rollout/{key}"] = value
            if c.get("weight_syncs"):
                logs["sync/weight_syncs"] = c["weight_syncs"]
            if c.get("merge_lost_syncs"):
                logs["sync/merge_lost_fraction"] = c["merge_lost_sum"] / c["merge_lost_syncs"]
            if self.mismatch_warn is not None:
                logs.update(self._pop_mismatch())
            if c.get("buffer_fresh", 0) + c.get("buffer_replay", 0):
                logs["buffer/replayed_steps"] = c.get("buffer_replay", 0.0)
                logs["buffer/max_staleness_steps"] = float(self._max_staleness)
                self._max_staleness = 0
            if c.get("packed_segments"):
                logs["packing/segments_per_row"] = c["packed_segments"] / c["rows"]
                logs["packing/carried"] = c["packing_carried"] / c["packing_steps"]
            if c.get("rows"):
                steps = c.get("packing_steps") or c.get("padded_steps") or 1.0
                logs["batch/rows_per_step"] = c["rows"] / steps
                logs["batch/filler_rows"] = c.get("filler_rows", 0.0)
            if graphs or self._graphs_logged:
                logs["compile/new_graphs"] = float(graphs - self._graphs_logged)
                self._graphs_logged = graphs
            if sums[-2]:
                logs["compile/recompiles_after_first_step"] = sums[-1]
            logs.update(gpu_memory_snapshot(self.timers))
            logs.update(self.gc_clock.pop())
        super().log(logs, start_time)
