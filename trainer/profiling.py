"""Kernel-level profile of one training step's forward + backward of every packed row (``training.profile_steps``).

``categorize`` and ``summarize`` are pure: kernel (or, on the CPU, operator) names and their self times in, the
seconds per category, the busy fraction of the profiled wall time and the top kernels out. ``profile_region`` is
the edge: it runs ``torch.profiler`` around a region (``train``: a step's forward + backward of every packed row; ``weight_sync``: the
push of the learner's weights into the rollout engine) and writes ``step<N>_<region>.json`` (the summary) and
``step<N>_<region>_kernels.txt`` (the profiler's own table) under a directory, plus a gzipped Chrome trace on request;
a GPU ``weight_sync`` region also records Python stacks and groups its host-to-device copies by the code that issued
them (``host_to_device_sources``), and traces every aten operator that reads a host tensor into a device result with
the Python frames that called it (``HostToDeviceTracer``, ``host_to_device_ops``): the profiler's stacks came back empty
for the 8B sync's 146 pageable copies (H100, 2026-11-27), so the tracer names them from the dispatcher instead; a copy it
does not see was not issued through aten (a driver-level ``cudaMemcpy``). A GPU ``train`` region records every
operation that made the host wait for the device, by the Python frames that issued it (``HostSyncTracer``,
``host_syncs``: each wait drains the device's queue, so the launches after it are exposed), and writes the profiler's
table by host time as ``..._host.txt``.

Every region also counts the host's side (``host_side``): ``launches``, the CUDA runtime and driver calls that each
queue one kernel or graph (``LAUNCH_CALLS``), and ``host_self_s``, the profiled operators' and API calls' own CPU
time. A region whose ``host_self_s`` nears its wall time while ``busy_fraction`` stays low is launch-bound: the host
cannot queue the kernels as fast as the device runs them (H100, 2026-11-27: ~3,700 launches a 4k row).

Invariants: every profiled kernel lands in exactly one category, so the categories sum to the device-busy time;
``busy_fraction`` = device-busy seconds / wall seconds of the region (below 1: the device waited on the host).
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import json
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

#: (category, lower-case substrings of a kernel or operator name), checked in this order
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flash", "fmha", "attention", "varlen", "sdpa", "attn")),
    ("optimizer", ("multi_tensor_apply", "adam", "_foreach", "fused_sgd")),
    ("loss", ("cross_entropy", "log_softmax", "logsoftmax", "softmax", "nll_loss")),
    ("norm", ("rms", "norm", "rsqrt")),
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "matmul", "aten::mm", "aten::addmm", "aten::bmm",
                "aten::linear", "splitk", "sm90_", "sm80_", "ampere_", "hopper_")),
    ("copy", ("memcpy", "memset", "copy", "catarray", "aten::cat", "aten::to", "index", "scatter", "gather")),
    ("reduction", ("reduce", "aten::sum", "aten::mean")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "aten::mul", "aten::add", "aten::silu", "aten::pow",
                     "aten::rsqrt", "aten::neg", "aten::div", "silu", "triton_")),
)


#: host-side profiler events that each queue one kernel (or one CUDA graph) on the device
LAUNCH_CALLS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                          "cudaLaunchCooperativeKernel", "cudaGraphLaunch"})


def host_side(events: Sequence[tuple[str, int, float]]) -> tuple[int, float]:
    """``(launches, host_self_s)`` of a region's host-side events, each ``(name, calls, self CPU seconds)``:
    the calls of ``LAUNCH_CALLS`` events, and the self CPU seconds of every event."""
    launches = sum(calls for name, calls, _ in events if name in LAUNCH_CALLS)
    return launches, sum(sec for _, _, sec in events)


def categorize(name: str) -> str:
    """The category of a kernel or operator name (``other`` when none matches)."""
    low = name.lower()
    for category, needles in CATEGORIES:
        if any(n in low for n in needles):
            return category
    return "other"


@dataclass(frozen=True)
class KernelTime:
    name: str
    seconds: float
    calls: int


@dataclass
class ProfileSummary:
    """What one profiled region spent, by category and by kernel."""

    step: int
    region: str
    wall_s: float
    device: str  # "cuda" (kernel times) or "cpu" (operator self times)
    busy_s: float
    busy_fraction: float
    by_category_s: dict[str, float]
    top: list[dict] = field(default_factory=list)
    #: ``weight_sync`` on a GPU: host-to-device copies grouped by the Python frames that issued them
    #: (``host_to_device_sources``)
    host_to_device: list[dict] = field(default_factory=list)
    #: ``weight_sync`` on a GPU: aten operators that read host tensors into device results, by caller
    #: (``HostToDeviceTracer``)
    host_to_device_ops: list[dict] = field(default_factory=list)
    #: ``train`` on a GPU: the operations that made the host wait for the device, by the Python frames that issued
    #: them (``HostSyncTracer``); each one drains the device's queue, so the launches after it are not hidden
    host_syncs: list[dict] = field(default_factory=list)
    #: ``train``: the packed rows (micro-batches) whose forward + backward the region covered, every one of the step's
    rows: int | None = None
    #: kernel (and graph) launches the host issued in the region (``LAUNCH_CALLS``; 0 on the CPU)
    launches: int = 0
    #: the host's own CPU seconds in the region: every profiled operator's and runtime call's self time, summed over
    #: the host's threads (the autograd thread's backward included, so it can exceed ``wall_s``)
    host_self_s: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


def summarize(kernels: Sequence[KernelTime], wall_s: float, step: int, device: str, top_n: int = 25,
              region: str = "train") -> ProfileSummary:
    """Seconds per category (summing to the busy time), the busy fraction and the ``top_n`` kernels by time."""
    by_cat: dict[str, float] = {}
    for k in kernels:
        by_cat[categorize(k.name)] = by_cat.get(categorize(k.name), 0.0) + k.seconds
    busy = sum(k.seconds for k in kernels)
    ranked = sorted(kernels, key=lambda k: k.seconds, reverse=True)[:top_n]
    top = [{"name": k.name[:160], "category": categorize(k.name), "seconds": k.seconds, "calls": k.calls,
            "share": k.seconds / busy if busy else 0.0} for k in ranked]
    return ProfileSummary(step=step, region=region, wall_s=wall_s, device=device, busy_s=busy,
                          busy_fraction=busy / wall_s if wall_s > 0 else 0.0,
                          by_category_s=dict(sorted(by_cat.items(), key=lambda kv: -kv[1])), top=top)


#: frames of these files say nothing about who asked for a copy (torch's own package: ``is_plumbing``)
_PLUMBING = ("contextlib.py", "threading.py", "<built-in")


@functools.lru_cache(maxsize=1)
def _torch_dir() -> str:
    import torch

    return os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def is_plumbing(frame: str, torch_dir: str | None = None) -> bool:
    """Whether a recorded frame (``path:line name`` or ``path(line): name``) is torch's own code or generic plumbing.
    Torch's frames are those under its package directory (``torch_dir``, default this process's): a substring test
    for ``/torch/`` also dropped every package of an environment installed under a folder named ``torch`` (the GPU
    machines' ``/opt/torch/.venv``: transformers' and accelerate's frames vanished from a 2026-11-27 profile)."""
    return frame.startswith(torch_dir or _torch_dir()) or any(m in frame for m in _PLUMBING)


def host_to_device_sources(ops: Sequence[tuple[Sequence[str], Sequence[tuple[str, float]]]], frames: int = 6,
                           top_n: int = 12) -> list[dict]:
    """Host-to-device copies by where they came from. ``ops``: per profiled operator, its Python stack (innermost
    frame first, as ``torch.profiler`` records it with ``with_stack``) and its device kernels (name, seconds). Only
    ``Memcpy HtoD`` kernels count; each is attributed to the operator's first ``frames`` frames outside torch's own
    plumbing. Returns the ``top_n`` sources by calls: ``frames``, ``calls``, ``seconds``, ``pageable`` (calls from
    pageable host memory, each one a host wait)."""
    groups: dict[tuple[str, ...], dict] = {}
    for stack, kernels in ops:
        copies = [(name, sec) for name, sec in kernels if "htod" in name.lower().replace(" ", "")]
        if not copies:
            continue
        key = tuple(f for f in stack if not is_plumbing(f))[:frames]
        g = groups.setdefault(key, {"frames": list(key), "calls": 0, "seconds": 0.0, "pageable": 0})
        g["calls"] += len(copies)
        g["seconds"] += sum(sec for _, sec in copies)
        g["pageable"] += sum(1 for name, _ in copies if "pageable" in name.lower())
    return sorted(groups.values(), key=lambda g: (-g["calls"], -g["seconds"]))[:top_n]


class HostToDeviceTracer:
    """While entered, every aten operator whose arguments hold a host (CPU) tensor and whose result holds a tensor on
    ``device_type`` is counted by its name and the Python frames that called it (outside torch's own plumbing, the
    innermost ``frames``). ``sources()``: the groups, most calls first: ``op``, ``frames``, ``calls``,
    ``host_bytes`` (the host tensors' bytes), ``pinned`` (calls whose host tensors were all page-locked)."""

    def __init__(self, device_type: str = "cuda", frames: int = 6, top_n: int = 12):
        self.device_type, self.frames, self.top_n = device_type, frames, top_n
        self._groups: dict[tuple, dict] = {}
        self._mode = None
        self.errors: list[str] = []

    def __enter__(self) -> HostToDeviceTracer:
        import traceback

        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        tracer = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                host = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)
                        and t.device.type == "cpu"]
                if host and any(isinstance(t, torch.Tensor) and t.device.type == tracer.device_type
                                for t in tree_leaves(out)):
                    try:
                        stack = [f"{f.filename}:{f.lineno} {f.name}"
                                 for f in reversed(traceback.extract_stack()[:-1])]
                        tracer._record(str(func), stack, host)
                    except Exception as exc:  # noqa: BLE001 - a diagnostic must not fail the sync it watches
                        tracer.errors.append(f"{type(exc).__name__}: {exc}")
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self._mode = None

    def _record(self, op: str, stack: list[str], host: list) -> None:
        frames = tuple(f for f in stack if not is_plumbing(f) and not f.startswith(__file__ + ":"))
        key = (op, frames[:self.frames])
        g = self._groups.setdefault(key, {"op": op, "frames": list(key[1]), "calls": 0, "host_bytes": 0, "pinned": 0})
        g["calls"] += 1
        g["host_bytes"] += sum(t.numel() * t.element_size() for t in host)
        g["pinned"] += int(all(t.is_pinned() for t in host)) if self.device_type == "cuda" else 0

    def sources(self) -> list[dict]:
        return sorted(self._groups.values(), key=lambda g: (-g["calls"], -g["host_bytes"]))[:self.top_n]


def group_host_syncs(stacks: Sequence[Sequence[str]], frames: int = 6, top_n: int = 12) -> list[dict]:
    """Host waits grouped by where they came from. ``stacks``: per wait, its Python stack (innermost frame first);
    each is keyed by its first ``frames`` frames outside torch's own plumbing. Returns the ``top_n`` groups, most
    calls first: ``frames``, ``calls``."""
    groups: dict[tuple[str, ...], dict] = {}
    for stack in stacks:
        key = tuple(f for f in stack if not is_plumbing(f))[:frames]
        groups.setdefault(key, {"frames": list(key), "calls": 0})["calls"] += 1
    return sorted(groups.values(), key=lambda g: -g["calls"])[:top_n]


#: the warning torch's sync debug mode issues for each operation that waits for the device
SYNC_WARNING = "called a synchronizing CUDA operation"


class HostSyncTracer:
    """While entered on a CUDA device, torch's sync debug mode (``torch.cuda.set_sync_debug_mode("warn")``) reports
    every operation that makes the host wait for the device (``.item()``, ``.tolist()``, ``nonzero``, a
    device-to-host copy, ...); each is recorded with the Python stack that issued it, and none is printed.
    ``sources()``: ``group_host_syncs`` of those stacks. Other warnings pass through unchanged."""

    def __init__(self, frames: int = 6, top_n: int = 12):
        self.frames, self.top_n = frames, top_n
        self.stacks: list[list[str]] = []
        self._warnings = None
        self._previous_mode = 0
        self._shown = None  # the showwarning in force when entered: what other warnings go to

    def _show(self, message, category, filename, lineno, file=None, line=None):
        import traceback

        if SYNC_WARNING in str(message):
            self.stacks.append([f"{f.filename}:{f.lineno} {f.name}" for f in reversed(traceback.extract_stack()[:-1])
                                if not f.filename.endswith("warnings.py")])
        else:
            self._shown(message, category, filename, lineno, file, line)

    def __enter__(self) -> HostSyncTracer:
        import warnings

        import torch

        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()  # restores the filters and ``showwarning`` on exit
        warnings.filterwarnings("always", message=f".*{SYNC_WARNING}.*")
        self._shown, warnings.showwarning = warnings.showwarning, self._show
        self._previous_mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        import torch

        torch.cuda.set_sync_debug_mode(self._previous_mode)
        self._warnings.__exit__(None, None, None)
        self._warnings = None

    def sources(self) -> list[dict]:
        return group_host_syncs(self.stacks, self.frames, self.top_n)


def _ops_with_kernels(prof) -> list[tuple[list[str], list[tuple[str, float]]]]:
    """(Python stack, [(kernel name, seconds)]) of every profiled operator that launched device work."""
    return [(list(ev.stack or ()), [(k.name, k.duration / 1e6) for k in ev.kernels]) for ev in prof.events()
            if ev.kernels]


def _kernel_times(averages, cuda: bool) -> list[KernelTime]:
    from torch.autograd import DeviceType

    out = []
    for ev in averages:
        if cuda:
            if ev.device_type != DeviceType.CUDA:
                continue
            us = getattr(ev, "self_device_time_total", None)
            if us is None:
                us = ev.self_cuda_time_total
        else:
            if not ev.key.startswith("aten::"):
                continue
            us = ev.self_cpu_time_total
        if us > 0:
            out.append(KernelTime(ev.key, us / 1e6, int(ev.count)))
    return out


def _host_events(averages) -> list[tuple[str, int, float]]:
    from torch.autograd import DeviceType

    return [(ev.key, int(ev.count), ev.self_cpu_time_total / 1e6) for ev in averages
            if ev.device_type == DeviceType.CPU]


@contextmanager
def profile_region(out_dir: Path, step: int, trace: bool = False, region: str = "train",
                   rows: int | None = None) -> Iterator[None]:
    """Profile the enclosed region (CUDA kernels when a GPU is present, else CPU operators) and write
    ``out_dir/step<step>_<region>.json``, ``..._kernels.txt`` and, with ``trace``, ``....trace.json.gz``; ``rows``:
    the packed rows the region trains, kept in the summary."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out_dir.mkdir(parents=True, exist_ok=True)
    stacks = region == "weight_sync" and cuda  # which code issues the sync's host-to-device copies
    tracer = HostToDeviceTracer() if stacks else contextlib.nullcontext()
    waits = HostSyncTracer() if region == "train" and cuda else contextlib.nullcontext()
    with profile(activities=activities, with_stack=stacks) as prof, tracer, waits:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        yield
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    averages = prof.key_averages()
    summary = summarize(_kernel_times(averages, cuda), wall, step, "cuda" if cuda else "cpu", region=region)
    summary.rows = rows
    summary.launches, summary.host_self_s = host_side(_host_events(averages))
    if stacks:
        summary.host_to_device = host_to_device_sources(_ops_with_kernels(prof))
        summary.host_to_device_ops = tracer.sources()
    if isinstance(waits, HostSyncTracer):
        summary.host_syncs = waits.sources()
    stem = f"step{step}_{region}"
    (out_dir / f"{stem}.json").write_text(json.dumps(summary.to_json(), indent=2))
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    (out_dir / f"{stem}_kernels.txt").write_text(averages.table(sort_by=sort, row_limit=60,
                                                                      max_name_column_width=90))
    if cuda:  # the host's side: where it launched, and where it waited (cudaStreamSynchronize, cudaMemcpy...)
        (out_dir / f"{stem}_host.txt").write_text(averages.table(sort_by="self_cpu_time_total",
                                                                     row_limit=60, max_name_column_width=90))
    if trace:
        raw = out_dir / f"{stem}.trace.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(str(raw) + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
