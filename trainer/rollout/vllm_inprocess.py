"""``InProcessVllm``: one ``vllm.LLM`` whose model lives in this process, the single wrapper both the colocate rollout
backend (``trainer.rollout.vllm_colocate``) and the ``vllm`` server engine (``trainer.server.vllm_engine``) use.

Contracts:
- weights are handed over as tensors in HF checkpoint naming (``load_weights``) and checked first
  (``trainer.sync.update_check``: known names, exact shapes, the served dtype unless ``allow_dtype_cast``, finite
  values); a refused update raises ``WeightUpdateRefused`` before any weight changes, so the engine keeps serving the
  old weights (vLLM cannot roll back a half-finished load, and a failed layerwise reload leaves meta tensors behind).
  The one exception is ``load_unmerged`` with ``sync.merge_into_engine``: it writes the LoRA products straight into
  the parameters of an engine that holds no valid weights (level 2 asleep) and checks what it wrote, so a refused
  update leaves it as its sleep did, without valid weights;
- the engine core and its worker run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) when
  ``tensor_parallel_size == 1`` or under an external launcher, so a load is a device-to-device copy into the live
  parameters; a multi-GPU server keeps vLLM's worker processes and sends the tensors through ``collective_rpc``;
- sleep mode (``sleep_level`` 1/2): the engine sleeps between uses. ``load_weights`` wakes only the weights (the KV
  cache stays released), ``generate`` wakes the rest. After a level-2 sleep the weights are gone: the next
  ``generate`` reloads them from ``weights_source`` (set by the caller, e.g. the learner's current weights) and fails
  naming that setting when there is none. ``sleep_level: kv_cache`` releases the KV cache alone: the weights stay
  mapped on the GPU between uses (a load writes into them, nothing is woken for it) and ``generate`` maps the KV
  cache back (``vllm_compat.release_kv_cache`` / ``map_kv_cache``); the prefix cache is reset before that decode;
- images are passed to multimodal models only (each expanded image-pad run collapsed to the one placeholder vLLM
  expands itself; the prompt ids vLLM returns are checked against ours by the caller); a text-only model decodes the
  prompt ids alone (as the HF backend does), and says so once in the log;
- one sleep-mode engine per process: vLLM's sleep-mode allocator (``CuMemAllocator``) is a per-process singleton,
  so a second sleep-mode engine in a process that already started one raises ``VllmEngineError`` before vLLM is
  called (``check_sleep_engine_slot``); a start failure names its cause (``explain_start_failure``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.rollout import vllm_compat
from trainer.telemetry import phase

log = logging.getLogger(__name__)

#: ``sleep_level`` value that releases the KV cache alone (the weights stay mapped)
KV_CACHE_ONLY = "kv_cache"
LORA_NAME = "rm_policy"
LORA_ID = 1


class VllmEngineError(RuntimeError):
    """vLLM failed; the message says what to change (no silent fallback to another backend)."""


@dataclass(frozen=True)
class VllmSettings:
    """How to start the engine; ``key`` is the config path the error messages name."""

    model_dir: str
    max_model_len: int
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.45
    enable_lora: bool = False
    max_lora_rank: int = 16
    enable_prefix_caching: bool = True
    sleep_level: int | str = 0  # 0, 1, 2 (vLLM's levels) or KV_CACHE_ONLY
    seed: int = 0
    dtype: str = "auto"
    external_launcher: bool = False
    allow_dtype_cast: bool = False
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    key: str = "custom.extra.rollout_matching.vllm"
    #: ``sync.recorded_load``: replay vLLM's recorded loader copies for an update like the last (``load_plan``)
    recorded_load: bool = False
    #: ``sync.overlap_wake``: ``load_weights`` wakes the weights while the update's finite check (and whatever the
    #: caller queued before it, e.g. the LoRA merge) runs on the device, and reads the check after the wake
    overlap_wake: bool = False
    #: ``sync.merge_into_engine``: ``load_unmerged`` writes an update's LoRA products straight into the parameters of
    #: an engine that holds no valid weights (level 2 asleep), through the recorded load
    merge_into_engine: bool = False


@dataclass(frozen=True)
class LoadReport:
    tensors: int
    bytes: int
    check_s: float
    load_s: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / max(self.check_s + self.load_s, 1e-9)


_sleep_engines_started = 0

ONE_ALLOCATOR_MARKERS = ("cumem allocator can only be used for one instance per process",)
OUT_OF_MEMORY_MARKERS = ("out of memory", "no available memory for the cache blocks", "free memory on device")


def sleep_engines_started() -> int:
    """How many sleep-mode engines this process has tried to start (successful or not)."""
    return _sleep_engines_started


def exception_chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes/contexts, outermost first (at most 16, cycles cut)."""
    seen: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and all(e is not s for s in seen) and len(seen) < 16:
        seen.append(e)
        e = e.__cause__ or e.__context__
    return seen


#: what an engine without valid weights (level 2 asleep) serves after a refused update
NO_VALID_WEIGHTS = "the engine holds no valid weights, as after its level-2 sleep, until an update passes"

#: free device memory a wake keeps beyond what it maps before it leaves torch's cached blocks in place
WAKE_HEADROOM_BYTES = 1 << 30


def _chain_text(exc: BaseException) -> str:
    return "\n".join(f"{type(e).__name__}: {e}" for e in exception_chain(exc))


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` or its causes say the device ran out of memory (torch's error or a message of vLLM's)."""
    return any(isinstance(e, torch.OutOfMemoryError) for e in exception_chain(exc)) or \
        any(m in _chain_text(exc).lower() for m in OUT_OF_MEMORY_MARKERS)


def wake_out_of_memory(tags: Sequence[str], exc: BaseException, settings: VllmSettings) -> torch.OutOfMemoryError:
    """The ``torch.OutOfMemoryError`` for a sleeping engine that could not map ``tags`` back: vLLM's message, the
    device's free memory and what torch's allocator still holds (``_wake_now`` released its cache when the free memory
    did not cover the pool)."""
    held = ""
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        held = (f"; {free / 2**30:.1f} of {total / 2**30:.1f} GiB free, torch holds "
                f"{torch.cuda.memory_reserved() / 2**30:.1f} GiB reserved "
                f"({torch.cuda.memory_allocated() / 2**30:.1f} GiB in tensors)")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return torch.OutOfMemoryError(
        f"CUDA out of memory: the sleeping vLLM engine could not map its {' + '.join(tags)} back ({first}){held}; "
        f"its pool is {settings.key}.gpu_memory_utilization={settings.gpu_memory_utilization:g} of the GPU and must "
        "fit beside what the learner's step left on it")


def one_allocator_message(settings: VllmSettings, sleep_engines_started_before: int) -> str:
    """Why a second sleep-mode engine cannot start in this process, and what to do instead."""
    s = settings
    before = (f"this process already started {sleep_engines_started_before} sleep-mode engine(s)"
              if sleep_engines_started_before else "memory of an earlier engine in this process is still in its pool")
    return (f"vLLM's sleep-mode allocator (CuMemAllocator) is one per process; {before} ({s.key}.sleep_level="
            f"{s.sleep_level}, model {s.model_dir}), and closing an engine does not free it for another. Run each "
            "sleep-mode engine in its own process (python -m trainer train, serve and bench each start one engine "
            f"per process; tests start a subprocess per engine) or set {s.key}.sleep_level 0")


def explain_start_failure(exc: BaseException, settings: VllmSettings, sleep_engines_started_before: int) -> str:
    """The ``VllmEngineError`` message for ``vllm.LLM(...)`` raising ``exc``: the one-allocator-per-process limit
    (vLLM's CuMem check, or any failure of a sleep-mode engine after another one in this process), memory (CUDA
    out of memory, no memory for the KV cache, too little free memory on the device), else neutral."""
    s = settings
    text = _chain_text(exc).lower()
    first = f"{type(exc).__name__}: {exc}"
    if any(m in text for m in ONE_ALLOCATOR_MARKERS) or (s.sleep_level and sleep_engines_started_before):
        return f"vLLM could not start for {s.model_dir} ({first}). " + one_allocator_message(s, sleep_engines_started_before)
    if is_out_of_memory(exc):
        return (f"vLLM ran out of GPU memory while starting for {s.model_dir} ({first}). Lower "
                f"{s.key}.gpu_memory_utilization (now {s.gpu_memory_utilization}) or {s.key}.max_model_len (now "
                f"{s.max_model_len}), or free the memory other processes on this GPU hold")
    return (f"vLLM could not start for {s.model_dir} ({first}). Check the model directory and the engine settings "
            f"({s.key}.max_model_len={s.max_model_len}, gpu_memory_utilization={s.gpu_memory_utilization}, "
            f"tensor_parallel_size={s.tensor_parallel_size}, sleep_level={s.sleep_level}, enable_lora={s.enable_lora}"
            f"{', engine_kwargs=' + str(sorted(s.engine_kwargs)) if s.engine_kwargs else ''}), or use "
            "custom.extra.rollout_matching.rollout_backend: hf")


def check_sleep_engine_slot(settings: VllmSettings, started: int | None = None) -> None:
    """Raise ``VllmEngineError`` when ``settings`` asks for sleep mode and this process (``started`` sleep-mode
    engines so far; default this module's count) already started one."""
    started = _sleep_engines_started if started is None else started
    if settings.sleep_level and started:
        raise VllmEngineError(f"not starting a second sleep-mode vLLM engine for {settings.model_dir}: "
                              + one_allocator_message(settings, started))


def _load_in_worker(worker, tensors: dict[str, torch.Tensor], recorded: bool = False) -> int:
    return vllm_compat.load_checkpoint_tensors(worker, tensors, recorded=recorded)


def _load_plan_mismatch_in_worker(worker, tensors: dict[str, torch.Tensor]) -> str | None:
    return vllm_compat.load_plan_mismatch(worker, tensors)


def _merge_in_worker(worker, tensors: dict[str, torch.Tensor], products: dict[str, Any]) -> list:
    return vllm_compat.merge_checkpoint_tensors(worker, tensors, products)


def _release_kv_cache_in_worker(worker) -> int:
    return vllm_compat.release_kv_cache(worker)


def _map_kv_cache_in_worker(worker) -> None:
    vllm_compat.map_kv_cache(worker)


def _pin_buffers_in_worker(worker) -> int:
    return vllm_compat.pin_saved_buffers(worker)


def _restore_buffers_in_worker(worker) -> int:
    return vllm_compat.restore_pinned_buffers(worker)


def _model_dtype_in_worker(worker) -> str:
    return str(next(vllm_compat.worker_model(worker).parameters()).dtype)


class InProcessVllm:
    """See the module docstring."""

    def __init__(self, settings: VllmSettings):
        self.settings = settings
        s = settings
        if s.sleep_level and not torch.cuda.is_available():
            raise ValueError(f"{s.key}.sleep_level={s.sleep_level} needs a CUDA GPU (vLLM's CPU backend cannot sleep); "
                             "set 0")
        check_sleep_engine_slot(s)
        if s.tensor_parallel_size == 1 or s.external_launcher:
            vllm_compat.run_engine_in_process()
        kwargs: dict[str, Any] = dict(
            model=s.model_dir, tensor_parallel_size=s.tensor_parallel_size, gpu_memory_utilization=s.gpu_memory_utilization,
            max_model_len=s.max_model_len, enable_prefix_caching=s.enable_prefix_caching, seed=s.seed, dtype=s.dtype)
        if s.enable_lora:
            kwargs.update(enable_lora=True, max_lora_rank=s.max_lora_rank, max_loras=1)
        if s.sleep_level:
            kwargs["enable_sleep_mode"] = True
        if s.external_launcher:
            kwargs["distributed_executor_backend"] = "external_launcher"
        # log-probabilities of the distribution each token was sampled from (temperature applied), as the learner's
        # side of the train-inference mismatch (trainer.sft.mismatch) computes them
        kwargs["logprobs_mode"] = "processed_logprobs"
        kwargs.update(s.engine_kwargs)
        if s.tensor_parallel_size > 1:
            off = vllm_compat.all_reduce_without_multicast(kwargs)
            if off:
                log.info("NVLink multicast is off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1): TP all-reduce without %s", off)
        self._dir = Path(tempfile.mkdtemp(prefix="rm-vllm-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
        from vllm import LLM

        global _sleep_engines_started
        started_before = _sleep_engines_started
        if s.sleep_level:
            _sleep_engines_started += 1
        try:
            self.llm = LLM(**kwargs)
        except Exception as exc:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise VllmEngineError(explain_start_failure(exc, s, started_before)) from exc
        self.multimodal = vllm_compat.is_multimodal(self.llm)
        self.image_token_id = vllm_compat.image_token_id(self.llm) if self.multimodal else None
        self.dtype = vllm_compat.served_dtype(self.llm)
        self.lora_request = None
        self.weights_source: Callable[[], dict[str, torch.Tensor]] | None = None
        self.last_load: LoadReport | None = None
        self._spec = None
        self._asleep: set[str] = set()
        self._weights_valid = True
        self._caches_stale = False
        self._warned_images = False
        self._waking: tuple[list[str], threading.Thread, list[BaseException]] | None = None
        self._merge_refused: str | None = None
        if s.sleep_level:
            self.sleep()

    # -- weights ---------------------------------------------------------------------------------------------------
    def update_spec(self):
        """Names, shapes and served dtype of every weight the engine takes (from the checkpoint's headers)."""
        if self._spec is None:
            from trainer.sync.update_check import spec_from_checkpoint

            self._spec = spec_from_checkpoint(self.settings.model_dir, self.dtype)
        return self._spec

    @contextlib.contextmanager
    def _refusal_outcome(self):
        """A ``WeightUpdateRefused`` raised inside says what the engine serves after it: nothing, for an engine that
        holds no valid weights (``NO_VALID_WEIGHTS``); the old weights otherwise."""
        from trainer.sync.update_check import WeightUpdateRefused

        try:
            yield
        except WeightUpdateRefused as exc:
            if self._weights_valid or exc.outcome == NO_VALID_WEIGHTS:
                raise
            raise WeightUpdateRefused(exc.tensor, exc.reason, NO_VALID_WEIGHTS) from None

    def load_weights(self, tensors: dict[str, torch.Tensor], *, checked: bool = False) -> LoadReport:
        """Check (unless ``checked``) and load HF-named ``tensors`` into the served model (see module docstring).

        With ``overlap_wake`` the names, shapes and dtypes are checked first, the finite check is launched, the
        weights wake (host work: vLLM maps its pool) while the device reduces, and the check is read (``sync_check_wait``)
        before anything is written: a refused update still changes no weight (level 1's wake restores the old ones,
        level 2's leaves the engine without valid weights, as its sleep did)."""
        from trainer.sync.update_check import start_check_update

        overlap = self.settings.overlap_wake and not checked
        with phase("sync_check"), self._refusal_outcome():
            t0 = time.perf_counter()
            pending = None if checked else start_check_update(tensors, self.update_spec(),
                                                              allow_cast=self.settings.allow_dtype_cast)
            if pending is not None and not overlap:
                pending.wait()
            check_s = time.perf_counter() - t0
        if self.dtype != next(iter(tensors.values())).dtype:
            tensors = {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        self.wake(("weights",), phase_name="sync_wake")
        if overlap and pending is not None:
            with phase("sync_check_wait"), self._refusal_outcome():
                t0 = time.perf_counter()
                pending.wait()
                check_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        with phase("sync_load"):
            if vllm_compat.engine_in_process():
                self.llm.collective_rpc(_load_in_worker, args=(tensors, self.settings.recorded_load))
            else:
                cpu = {k: v.detach().to("cpu") for k, v in tensors.items()}
                self.llm.collective_rpc(_load_in_worker, args=(cpu,))
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        load_s = time.perf_counter() - t0
        self._weights_valid = True
        self._caches_stale = True
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self.last_load = LoadReport(len(tensors), nbytes, check_s, load_s)
        return self.last_load

    def merge_refusal(self, update) -> str | None:
        """Why ``load_unmerged`` merges ``update`` on the learner's side instead of in the engine, or None when it
        can write the products straight into the parameters."""
        if not self.settings.merge_into_engine:
            return f"{self.settings.key}.sync.merge_into_engine is off"
        if not update.products:
            return "the update has no LoRA product to add"
        if self._weights_valid:
            return ("the engine holds valid weights (sleep_level is not 2, or it has not slept since its last load): "
                    "a refused update must leave them unchanged")
        if not vllm_compat.engine_in_process() or not self.settings.recorded_load:
            return f"the engine is not in this process or {self.settings.key}.sync.recorded_load is off"
        return self.llm.collective_rpc(_load_plan_mismatch_in_worker, args=(update.base,))[0]

    def load_unmerged(self, update) -> LoadReport:
        """Load ``update`` (``trainer.sync.weights.UnmergedWeights``: the learner's weights with the LoRA products
        still to add). With ``merge_into_engine``, when ``merge_refusal`` finds nothing against it: the layout is
        checked, the weights wake, each product's GEMM writes its engine parameter (the recorded load's copies for
        everything else; no merged copy of the model is made), then every written parameter is checked finite. A
        non-finite one raises ``WeightUpdateRefused`` and leaves the engine without valid weights, as its level-2
        sleep did (the next decode reloads from ``weights_source``). Otherwise the update is merged here
        (``sync_collect``) and loaded as ``load_weights`` loads it."""
        reason = self.merge_refusal(update)
        if reason is not None:
            if reason != self._merge_refused and self.settings.merge_into_engine:
                log.info("vllm.sync.merge_into_engine: merging on the learner's side: %s", reason)
            self._merge_refused = reason
            with phase("sync_collect", device_work=True):
                tensors = update.merged()
            return self.load_weights(tensors)
        self._merge_refused = None
        from trainer.sync.update_check import (
            WeightUpdateRefused,
            check_update_layout,
            describe_non_finite,
            launch_finite_check,
        )

        with phase("sync_check"), self._refusal_outcome():
            t0 = time.perf_counter()
            check_update_layout(update.base, self.update_spec(), allow_cast=self.settings.allow_dtype_cast)
            check_s = time.perf_counter() - t0
        self.wake(("weights",), phase_name="sync_wake")
        t0 = time.perf_counter()
        with phase("sync_load"):
            written = self.llm.collective_rpc(_merge_in_worker, args=(update.base, update.products))[0]
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        load_s = time.perf_counter() - t0
        with phase("sync_check"):
            t0 = time.perf_counter()
            bad = launch_finite_check({str(i): dst for i, (_, dst) in enumerate(written)}).first_bad()
            check_s += time.perf_counter() - t0
        self._caches_stale = True
        if bad is not None:
            name, dst = written[int(bad)]
            raise WeightUpdateRefused(name, describe_non_finite(dst) + " in the engine's parameter after the LoRA "
                                      "merge into it", NO_VALID_WEIGHTS)
        self._weights_valid = True
        nbytes = sum(t.numel() * t.element_size() for t in update.base.values())
        self.last_load = LoadReport(len(update.base), nbytes, check_s, load_s)
        return self.last_load

    def load_adapter(self, peft_config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Serve ``tensors`` (peft's saved names) as the LoRA adapter (replaced in place; needs ``enable_lora``)."""
        if not self.settings.enable_lora:
            raise ValueError(f"{self.settings.key}.enable_lora must be true to serve LoRA adapters")
        from safetensors.torch import save_file

        bad = next((k for k, v in tensors.items() if v.is_floating_point() and not torch.isfinite(v).all()), None)
        if bad is not None:
            from trainer.sync.update_check import WeightUpdateRefused

            raise WeightUpdateRefused(bad, "non-finite values (NaN or inf)")
        d = self._dir / "adapter"
        d.mkdir(exist_ok=True)
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps(peft_config))
        self.wake(("weights",), phase_name="sync_wake")
        self.lora_request = vllm_compat.add_lora(self.llm, LORA_NAME, LORA_ID, str(d))
        self._caches_stale = True

    def drop_adapter(self) -> None:
        self.lora_request = None
        self._caches_stale = True

    # -- sleep -----------------------------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Sleep at ``sleep_level``; after a level-2 sleep the model buffers vLLM saved are kept page-locked
        (``vllm_compat.pin_saved_buffers``) and written back with one copy when the weights wake. ``kv_cache``
        releases the KV cache and keeps the weights (see the module docstring)."""
        self._join_wake()
        level = self.settings.sleep_level
        if level == KV_CACHE_ONLY:
            if "kv_cache" not in self._asleep:
                with phase("sleep"):
                    self.llm.collective_rpc(_release_kv_cache_in_worker)
                self._asleep = {"kv_cache"}
                self._caches_stale = True
            return
        if level and not self._asleep:
            with phase("sleep"):
                self.llm.sleep(level=level)
                if level == 2:
                    self.llm.collective_rpc(_pin_buffers_in_worker)
            self._asleep = {"weights", "kv_cache"}
            if level == 2:
                self._weights_valid = False

    def _wake_now(self, todo: list[str]) -> None:
        """vLLM's wake of ``todo``, after handing torch's cached free blocks back to the driver when the device's free
        memory does not cover what the wake maps (``vllm_compat.sleeping_bytes`` + ``WAKE_HEADROOM_BYTES``; always
        when the allocator does not say): vLLM 0.26's wake maps its pool without doing so (0.32's empties the cache
        itself), so the blocks a learner's backward left cached in this process kept the engine from mapping its KV
        cache back (H100, 2026-11-26); where the memory is free anyway the release is left to vLLM's next sleep
        (0.26's cumem ``sleep`` empties the cache), outside the weight sync; the ``kv_cache`` sleep never empties it,
        so there this check is the only release. Timed as ``wake_cache_release``. Its allocator's
        out-of-memory (a ``RuntimeError`` from ``cumem_allocator.cpp``, not torch's error) is raised as
        ``torch.OutOfMemoryError`` (``wake_out_of_memory``), so that the step's out-of-memory handling names the
        phase and what to change."""
        if torch.cuda.is_available():
            need = vllm_compat.sleeping_bytes(todo)
            if need is None or torch.cuda.mem_get_info()[0] < need + WAKE_HEADROOM_BYTES:
                with phase("wake_cache_release"):
                    torch.cuda.empty_cache()
        try:
            if self.settings.sleep_level == KV_CACHE_ONLY:
                self.llm.collective_rpc(_map_kv_cache_in_worker)
            else:
                self.llm.wake_up(tags=todo)
        except Exception as exc:
            if isinstance(exc, torch.OutOfMemoryError) or not is_out_of_memory(exc):
                raise
            raise wake_out_of_memory(todo, exc, self.settings) from exc
        if "weights" in todo:
            self.llm.collective_rpc(_restore_buffers_in_worker)

    def wake_in_background(self, tags: Sequence[str] = ("weights",)) -> bool:
        """Start waking what of ``tags`` sleeps on a thread (vLLM's wake is host work: one driver mapping per
        allocation), so that it overlaps the learner's checks and LoRA merge on the GPU; the next ``wake`` or
        ``sleep`` waits for it and raises its error there, unchanged. Returns whether a wake was started."""
        todo = [t for t in tags if t in self._asleep]
        if not todo or self._waking is not None:
            return False
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        errors: list[BaseException] = []

        def run() -> None:
            try:
                if device is not None:
                    torch.cuda.set_device(device)
                self._wake_now(todo)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread by _join_wake
                errors.append(exc)

        thread = threading.Thread(target=run, name="rm-vllm-wake", daemon=True)
        self._waking = (todo, thread, errors)
        thread.start()
        return True

    def _join_wake(self) -> None:
        if self._waking is None:
            return
        todo, thread, errors = self._waking
        thread.join()
        self._waking = None
        if errors:  # the error the wake would have raised on this thread (a CUDA OOM stays an OOM for its advice)
            raise errors[0]
        self._asleep -= set(todo)

    def wake(self, tags: Sequence[str] = ("weights", "kv_cache"), phase_name: str = "wake") -> None:
        """Wake what of ``tags`` sleeps (timed as the step's ``phase_name`` sub-phase when something does; a wake
        started by ``wake_in_background`` is waited for inside that phase)."""
        if self._waking is not None:
            with phase(phase_name):
                self._join_wake()
        todo = [t for t in tags if t in self._asleep]
        if todo:
            with phase(phase_name):
                self._wake_now(todo)
            self._asleep -= set(todo)

    @property
    def asleep(self) -> bool:
        return bool(self._asleep)

    def _ready(self) -> None:
        if not self._weights_valid:
            if self.weights_source is None:
                raise VllmEngineError(f"{self.settings.key}.sleep_level=2 discarded the weights and no weights were "
                                      "loaded since; sync weights before decoding (or use sleep_level 1)")
            self.load_weights(self.weights_source())
        self.wake()
        if self._caches_stale:
            vllm_compat.reset_weight_caches(self.llm)
            self._caches_stale = False

    # -- decoding --------------------------------------------------------------------------------------------------
    def prompt(self, prompt_token_ids: Sequence[int], images: Sequence[Any] = ()) -> dict[str, Any]:
        """A vLLM token prompt; ``images`` (PIL images) only for a multimodal model."""
        p: dict[str, Any] = {"prompt_token_ids": list(prompt_token_ids)}
        if images and self.multimodal:
            if self.image_token_id is not None:
                p["prompt_token_ids"] = vllm_compat.collapse_image_placeholders(prompt_token_ids, self.image_token_id)
            p["multi_modal_data"] = {"image": list(images)}
        elif images and not self._warned_images:
            log.info("the served model is text-only: request images are not passed to vLLM (the prompt ids decide)")
            self._warned_images = True
        return p

    def generate(self, prompts: list[dict[str, Any]], sampling_params) -> list[vllm_compat.Decoded]:
        """Decode ``prompts`` (from ``prompt``) in order; prompt ids as vLLM saw them, new token ids, finish reason."""
        self._ready()
        try:
            outputs = self.llm.generate(prompts, sampling_params, lora_request=self.lora_request, use_tqdm=False)
        except torch.OutOfMemoryError as exc:
            raise VllmEngineError(
                f"vLLM ran out of memory while decoding {len(prompts)} requests; lower {self.settings.key}."
                "gpu_memory_utilization, custom.extra.rollout_matching.rollout_generate_batch_size or "
                "decoding.max_new_tokens") from exc
        return [vllm_compat.decoded(o) for o in outputs]

    def reset_prefix_cache(self) -> bool:
        """Drop the caches computed from the served weights (``vllm_compat.reset_weight_caches``): now, or at the next
        decode when asleep."""
        if self._asleep:
            self._caches_stale = True
            return True
        return vllm_compat.reset_weight_caches(self.llm)

    def collective_rpc(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Run ``fn(worker, *args)`` on every vLLM worker (in this process when the engine is in-process)."""
        return self.llm.collective_rpc(fn, args=args)

    def model_dtype(self) -> str:
        return self.llm.collective_rpc(_model_dtype_in_worker)[0]

    def close(self) -> None:
        """Shut the engine down and free its memory; an in-process engine that owns its distributed state (not under
        an external launcher, whose process group is the learner's) also tears that down, so a later engine in this
        process starts clean. A sleeping engine is woken first: vLLM's sleep-mode allocator (cumem) unmaps sleeping
        memory, freeing it unmapped fails (``CUDA Error: invalid argument`` in ``cumem_allocator.cpp``), and that
        error stays set in the allocator, so every later sleep-mode engine in this process failed to allocate."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            try:
                self.wake()
            except Exception:  # noqa: BLE001 - closing anyway; a later engine reports its own failure
                log.exception("could not wake the sleeping vLLM engine before closing it")
            core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            self.llm = None
            del llm
            if vllm_compat.engine_in_process() and not self.settings.external_launcher:
                vllm_compat.release_distributed_state()
        shutil.rmtree(self._dir, ignore_errors=True)
