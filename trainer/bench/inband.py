"""In-band weight push learner → rollout server over HTTP, before and after the fix of b1c8efc (CPU-runnable).

One real ``python -m trainer serve --engine scripted --model <tiny model>`` subprocess on loopback receives bf16
payloads of 64 MiB, 256 MiB and 1 GiB (8 weight matrices of 1024 columns each), three ways, side by side in one run:

* ``before``: the old learner path, reproduced here — ``safetensors.torch.save({k: v.cpu().clone()})`` to ``bytes``,
  then ``httpx.Client.post(content=<bytes>)`` (httpcore re-slices a ``bytes`` body after every partial send:
  quadratic copying). Skipped, with the reason recorded, at a size when the previous size already took more than
  ``before_cap_s`` or its quadratic extrapolation (time × size ratio²) exceeds ``before_predicted_cap_s``.
* ``after``: ``InbandTransport.push_full`` (``trainer.sync.wire.encode`` into one buffer, sent as zero-copy
  ``memoryview`` slices with ``Content-Length``).
* ``shm``: ``InbandTransport(shm_dir=…).push_full`` — the payload written once into a staging file in a directory the
  server also sees (``/dev/shm`` here; the server runs with ``--shm-dir``), only its name posted; the server reads the
  file (``trainer.sync.shm_staging``).
* ``raw_copy``: one ``bytearray(n)`` plus one torch copy of the payload into it — what a single memcpy of the update
  costs on this machine (the floor of any path that serialises the weights once).

Both pushes hit the server's current ``_read_body`` (one ``Content-Length`` buffer) and ``wire.decode``. The tensor
names are not the tiny model's, so the scripted engine refuses every timed push with HTTP 422 — after the whole body
was read and decoded (the name check is the first thing ``load_full`` does, and costs nothing); the refusal is
checked for every push. The scripted engine takes its spec from the ``--model`` checkpoint, so arbitrary names are
never accepted with 200 there (without ``--model`` only the first full update fixes the spec, and every later size
would be refused for its shapes). One small push of the tiny model's own weights checks that the path is accepted
(``accepted_check``). Writes ``inband.json`` and ``inband.png``::

    python -m trainer bench --only inband          # or: trainer.bench.inband.run(out_dir)
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

GB = 1e9
MIB = 2**20
SIZES_MIB = (64, 256, 1024)
QUICK_SIZES_MIB = (1, 4)
VARIANTS = ("raw_copy", "shm", "after", "before")
COLUMNS = 1024
REFUSAL = "not a weight of the served model"


def payload(nbytes: int, n_tensors: int = 8) -> dict[str, torch.Tensor]:
    """``n_tensors`` bf16 matrices ``(rows, 1024)`` of ``nbytes`` in all (pages touched: filled, not empty)."""
    rows = max(1, nbytes // (n_tensors * COLUMNS * 2))
    return {f"bench.layers.{i}.mlp.weight": torch.full((rows, COLUMNS), 0.01 * (i + 1), dtype=torch.bfloat16)
            for i in range(n_tensors)}


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def raw_copy(tensors: dict[str, torch.Tensor]) -> float:
    """Seconds for ``bytearray(n)`` + one copy of every tensor into it."""
    t0 = time.perf_counter()
    buf = bytearray(_nbytes(tensors))
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    pos = 0
    for t in tensors.values():
        n = t.numel() * t.element_size()
        flat[pos:pos + n].copy_(t.reshape(-1).view(torch.uint8))
        pos += n
    dt = time.perf_counter() - t0
    del flat, buf
    return dt


def push_before(client: Any, url: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The pre-b1c8efc learner path: safetensors' ``save`` of host clones, then one ``bytes`` body."""
    from safetensors.torch import save

    from trainer.sync.transports import INBAND_PATH

    t0 = time.perf_counter()
    blob = save({k: v.cpu().clone() for k, v in tensors.items()})
    t1 = time.perf_counter()
    resp = client.post(url + INBAND_PATH, params={"kind": "full"}, content=blob,
                       headers={"content-type": "application/octet-stream"})
    t2 = time.perf_counter()
    refused = resp.status_code == 422 and REFUSAL in resp.text
    return {"seconds": t2 - t1 + (t1 - t0), "encode_s": t1 - t0, "post_s": t2 - t1, "status": resp.status_code,
            "whole_body_read": refused, "answer": resp.text[:200]}


def push_after(transport: Any, endpoint: Any, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    t0 = time.perf_counter()
    failed = transport.push_full(tensors, [endpoint])
    dt = time.perf_counter() - t0
    err = failed.get(endpoint.base_url, "")
    return {"seconds": dt, "status": 422 if "HTTP 422" in err else (200 if not failed else None),
            "whole_body_read": "HTTP 422" in err and REFUSAL in err, "answer": err[:200]}


@contextlib.contextmanager
def scripted_server(model_dir: Path, timeout_s: float = 120.0, shm_dir: Path | None = None) -> Iterator[tuple[str, float]]:
    """``python -m trainer serve --engine scripted --model model_dir [--shm-dir shm_dir]`` on a free loopback port;
    yields ``(base_url, seconds to healthy)``; terminated at the end."""
    from trainer.launch.health import serve_subprocess

    extra = ("--shm-dir", str(shm_dir)) if shm_dir is not None else ()
    with serve_subprocess("--engine", "scripted", "--model", str(model_dir), *extra, timeout_s=timeout_s) as (url, _, took):
        yield url, took


def _accepted_check(transport: Any, endpoint: Any, model_dir: Path) -> dict[str, Any]:
    """Push the tiny model's own weights: the in-band path is accepted (HTTP 200) end to end."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    t0 = time.perf_counter()
    failed = transport.push_full(tensors, [endpoint])
    return {"tensors": len(tensors), "bytes": _nbytes(tensors), "seconds": time.perf_counter() - t0,
            "accepted": not failed, "error": failed.get(endpoint.base_url)}


def _stats(runs: Sequence[dict[str, Any]], nbytes: int) -> dict[str, Any]:
    secs = [r["seconds"] for r in runs]
    best = min(secs)
    out: dict[str, Any] = {"seconds": best, "seconds_all": secs, "GBps": nbytes / best / GB}
    for key in ("encode_s", "post_s"):
        if key in runs[0]:
            out[key] = min(r[key] for r in runs)
    for key in ("status", "whole_body_read", "answer"):
        if key in runs[0]:
            out[key] = runs[-1][key]
    return out


def machine_info() -> dict[str, Any]:
    import httpcore
    import httpx
    import safetensors

    mem = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return {"cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "memory_gib": mem,
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(), "torch": torch.__version__, "httpx": httpx.__version__,
            "httpcore": httpcore.__version__, "safetensors": safetensors.__version__}


def run(out_dir: str | Path, *, sizes_mib: Sequence[int] = SIZES_MIB, repeats: int = 2, big_repeats: int = 2,
        big_mib: int = 1024, before_cap_s: float = 20.0, before_predicted_cap_s: float = 30.0, n_tensors: int = 8,
        model_dir: str | Path | None = None) -> dict[str, Any]:
    """The benchmark (module docstring); writes ``out_dir/inband.json`` and ``inband.png`` and returns the result.
    Sizes of ``big_mib`` or more are timed ``big_repeats`` times, the others ``repeats`` times (best kept)."""
    import httpx

    from trainer.rollout.server_client import ServerEndpoint
    from trainer.sync.transports import InbandTransport

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if model_dir is None:
            from trainer.modeling.fixtures import save_tiny_model

            model_dir = save_tiny_model(Path(stack.enter_context(tempfile.TemporaryDirectory())) / "tiny", "text")
        model_dir = Path(model_dir)
        shm_root = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
        shm_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rm-bench-shm-", dir=shm_root)))
        url, startup_s = stack.enter_context(scripted_server(model_dir, shm_dir=shm_dir))
        endpoint = ServerEndpoint(url)
        transport = InbandTransport(timeout_s=600.0)
        stack.callback(transport.close)
        shm_transport = InbandTransport(timeout_s=600.0, shm_dir=str(shm_dir))
        stack.callback(shm_transport.close)
        client = stack.enter_context(httpx.Client(timeout=600.0))
        accepted = _accepted_check(transport, endpoint, model_dir)
        warm = payload(MIB, n_tensors)  # first calls (lazy imports, connection, allocator) out of the timings
        raw_copy(warm), push_after(transport, endpoint, warm), push_before(client, url, warm)
        push_after(shm_transport, endpoint, warm)
        rows: list[dict[str, Any]] = []
        skipped: list[dict[str, Any]] = []
        prev_before: tuple[int, float] | None = None
        for mib in sizes_mib:
            tensors = payload(mib * MIB, n_tensors)
            nbytes = _nbytes(tensors)
            reps = big_repeats if mib >= big_mib else repeats
            row: dict[str, Any] = {"size_mib": mib, "bytes": nbytes, "tensors": len(tensors),
                                   "shapes": sorted({tuple(t.shape) for t in tensors.values()}), "repeats": reps}
            row["raw_copy"] = _stats([{"seconds": raw_copy(tensors)} for _ in range(reps)], nbytes)
            gc.collect()
            row["shm"] = _stats([push_after(shm_transport, endpoint, tensors) for _ in range(reps)], nbytes)
            gc.collect()
            row["after"] = _stats([push_after(transport, endpoint, tensors) for _ in range(reps)], nbytes)
            gc.collect()
            predicted = prev_before[1] * (mib / prev_before[0]) ** 2 if prev_before else 0.0
            if prev_before is not None and (prev_before[1] > before_cap_s or predicted > before_predicted_cap_s):
                reason = (f"before at {prev_before[0]} MiB took {prev_before[1]:.1f} s (cap {before_cap_s:g} s); "
                          f"quadratic growth predicts {predicted:.0f} s at {mib} MiB (cap {before_predicted_cap_s:g} s): "
                          "not run, to keep the benchmark short")
                row["before"] = {"skipped": reason}
                skipped.append({"variant": "before", "size_mib": mib, "reason": reason})
            else:
                row["before"] = _stats([push_before(client, url, tensors) for _ in range(reps)], nbytes)
                prev_before = (mib, row["before"]["seconds"])
            gc.collect()
            before_s = row["before"].get("seconds")
            row["after_vs_before_speedup"] = before_s / row["after"]["seconds"] if before_s else None
            row["after_vs_raw_copy"] = row["after"]["seconds"] / row["raw_copy"]["seconds"]
            row["shm_vs_raw_copy"] = row["shm"]["seconds"] / row["raw_copy"]["seconds"]
            row["shm_vs_after_speedup"] = row["after"]["seconds"] / row["shm"]["seconds"]
            rows.append(row)
            del tensors
            gc.collect()
            _print_row(row)
    result: dict[str, Any] = {
        "benchmark": "in-band weight push learner -> `python -m trainer serve --engine scripted` (loopback HTTP)",
        "machine": machine_info(),
        "date": time.strftime("%Y-%m-%d"),
        "server": {"engine": "scripted", "model": "trainer.modeling.fixtures.save_tiny_model(dir, 'text')",
                   "startup_s": startup_s,
                   "timed_pushes": "refused with HTTP 422 (unknown names) after the whole body was read and decoded; "
                                   "'whole_body_read' checks the refusal text of every push"},
        "accepted_check": accepted,
        "variants": {
            "before": "safetensors.torch.save({k: v.cpu().clone()}) -> bytes; httpx.Client.post(content=bytes) "
                      "(the learner path before b1c8efc; the server side is the current one)",
            "after": "InbandTransport.push_full (wire.encode into one buffer; memoryview chunks + Content-Length)",
            "shm": "InbandTransport(shm_dir=/dev/shm/...).push_full: payload written into a staging file the server "
                   "reads (serve --shm-dir); only its name goes over HTTP",
            "raw_copy": "bytearray(n) + one torch copy of every tensor into it (no HTTP)",
        },
        "seconds": "best of 'repeats' (all in seconds_all); GBps = bytes / seconds / 1e9",
        "before_cap_s": before_cap_s,
        "before_predicted_cap_s": before_predicted_cap_s,
        "skipped": skipped,
        "results": rows,
        "total_run_s": time.perf_counter() - t_start,
    }
    (out / "inband.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "inband.png")
    return result


def _print_row(row: dict[str, Any]) -> None:
    parts = []
    for v in VARIANTS:
        r = row[v]
        parts.append(f"{v} skipped" if "skipped" in r else f"{v} {r['seconds']:.2f} s {r['GBps']:.2f} GB/s")
    ratio = row["after_vs_before_speedup"]
    print(f"inband {row['size_mib']:5d} MiB: " + " | ".join(parts)
          + (f" | after {ratio:.1f}x faster than before" if ratio else ""), flush=True)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"raw_copy": "raw copy (bytearray + memcpy, no HTTP)", "after": "after: InbandTransport.push_full",
              "shm": "shared directory: InbandTransport(shm_dir)",
              "before": "before: safetensors.save + httpx bytes body"}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for v, marker in zip(VARIANTS, ("s", "D", "o", "x")):
        pts = [(r["size_mib"], r[v]["GBps"]) for r in result["results"] if "GBps" in r.get(v, {})]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=labels[v])
    for s in result["skipped"]:
        ax.annotate(f"{s['variant']} skipped\n(predicted > {result['before_predicted_cap_s']:g} s)",
                    (s["size_mib"], 0), xytext=(0, 12), textcoords="offset points", ha="center", fontsize=8)
    ax.set_xscale("log", base=2)
    sizes = [r["size_mib"] for r in result["results"]]
    ax.set_xticks(sizes, [f"{s} MiB" if s < 1024 else f"{s // 1024} GiB" for s in sizes])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("payload (bf16, 8 tensors)")
    ax.set_ylabel("GB/s (1e9 bytes / s)")
    m = result["machine"]
    ax.set_title(f"in-band weight push to a scripted server (loopback)\n{m['cpu_cores']} cores, torch {m['torch']}",
                 fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
