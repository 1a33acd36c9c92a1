"""``vllm.pixels_during_decode``: an engine that reads the image files (vLLM colocate) gets prompt ids built from each
image's size alone, and the training pixels are made on a worker thread while it decodes. The ids, pixels and
training are the same as when the pixels are made first; a grid that does not match fails naming the sample."""

from __future__ import annotations

import pytest
import torch
from transformers import TrainingArguments

from trainer.data.records import DatasetError, load_jsonl
from trainer.data.synthetic import generate
from trainer.modeling.coord_vocab import stop_token_ids
from trainer.modeling.fixtures import build_tiny_image_processor, build_tiny_model, tiny_tokenizer
from trainer.modeling.prompts import PromptEncoder
from trainer.packing.buffer import PackingBuffer
from trainer.rollout.hf import HFRolloutEngine
from trainer.rollout.types import DecodingParams
from trainer.sft.settings import LayoutSettings, RolloutSettings, TrainerSettings
from trainer.sft.stage2 import Stage2Pipeline
from trainer.sft.trainer import RolloutMatchingTrainer, SampleDataset


def _processor(longest: int = 128 * 128):
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                    size={"shortest_edge": 32 * 32, "longest_edge": longest})


@pytest.mark.parametrize(("width", "height"), [(64, 64), (640, 480), (31, 200), (1024, 1024), (3000, 17), (33, 33)])
def test_the_grid_from_the_size_is_the_processors(width, height):
    from PIL import Image

    proc = _processor(1024 * 1024)
    enc = PromptEncoder(tiny_tokenizer(), proc)
    out = proc(images=[Image.new("RGB", (width, height))], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [enc.image_grid(width, height)]


def test_prompt_ids_and_pixels_are_the_same_either_way(tmp_path):
    samples = load_jsonl(generate(tmp_path / "data", 3, seed=1, max_objects=3, image_size=96))
    pipe = Stage2Pipeline(PromptEncoder(tiny_tokenizer(), build_tiny_image_processor(), pixel_dtype=torch.bfloat16))
    full, _ = pipe.requests(samples)
    light, _ = pipe.requests(samples, pixels=False)
    assert all("pixel_values" not in r.mm_inputs for r in light)
    assert [r.prompt_token_ids for r in light] == [r.prompt_token_ids for r in full]
    done = pipe.with_pixels(samples, light)
    for a, b in zip(done, full):
        assert torch.equal(a.mm_inputs["pixel_values"], b.mm_inputs["pixel_values"])
        assert a.mm_inputs["pixel_values"].dtype == torch.bfloat16
        assert torch.equal(a.mm_inputs["image_grid_thw"], b.mm_inputs["image_grid_thw"])


def test_a_grid_that_does_not_match_names_the_sample(tmp_path):
    samples = load_jsonl(generate(tmp_path / "data", 1, seed=2, max_objects=2, image_size=96))
    pipe = Stage2Pipeline(PromptEncoder(tiny_tokenizer(), _processor()))
    light, _ = pipe.requests(samples, pixels=False)
    pipe.encoder.image_processor.size["longest_edge"] = 32 * 32  # the processor now makes a smaller grid
    with pytest.raises(DatasetError, match=samples[0].sample_id):
        pipe.with_pixels(samples, light)


class ImageReadingEngine:
    """Decodes like the HF engine, but from the requests as an image-reading engine gets them: it must never see
    pixel values when they are made during the decode, so it makes its own (as vLLM does from the files)."""

    name = "image-reading"
    reads_images = True

    def __init__(self, engine, pipeline):
        self.engine, self.pipeline, self.saw_pixels = engine, pipeline, []

    def generate(self, requests, params):
        self.saw_pixels.extend("pixel_values" in r.mm_inputs for r in requests)
        own = self.pipeline.requests([self.samples[r.sample_id] for r in requests])[0]
        assert [r.prompt_token_ids for r in own] == [r.prompt_token_ids for r in requests]
        return self.engine.generate(own, params)

    def close(self):
        pass


def _train(tmp_path, samples, during: bool):
    model, tok = build_tiny_model("vl", seed=0)
    pipe = Stage2Pipeline(PromptEncoder(tok, build_tiny_image_processor()))
    engine = ImageReadingEngine(HFRolloutEngine(model, tok.pad_token_id, sorted(stop_token_ids(tok)), 4), pipe)
    engine.samples = {s.sample_id: s for s in samples}
    args = TrainingArguments(output_dir=str(tmp_path / f"out-{during}"), max_steps=2, per_device_train_batch_size=2,
                             learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], seed=0,
                             remove_unused_columns=False, disable_tqdm=True, use_cpu=True)
    trainer = RolloutMatchingTrainer(model=model, args=args, train_dataset=SampleDataset(samples), pipeline=pipe,
                                     engine=engine, processing_class=tok, packing=PackingBuffer(2048, 16),
                                     settings=TrainerSettings(
                                         rollout=RolloutSettings(DecodingParams(max_new_tokens=12),
                                                                 pixels_during_decode=during),
                                         layout=LayoutSettings(packed_attn_implementation="sdpa",
                                                               image_token_id=model.config.image_token_id)))
    assert trainer.pixels_during_decode == during
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    pixel_s = [r.get("time/pixels_during_decode_s") for r in trainer.state.log_history if "loss" in r]
    assert all(s is not None and s > 0 for s in pixel_s) if during else not any(pixel_s), pixel_s
    return losses, engine.saw_pixels


def test_training_is_the_same_with_the_pixels_made_during_the_decode(tmp_path):
    samples = load_jsonl(generate(tmp_path / "data", 4, seed=3, max_objects=2, image_size=64))
    before, saw_before = _train(tmp_path, samples, during=False)
    during, saw_during = _train(tmp_path, samples, during=True)
    assert all(saw_before) and not any(saw_during), "the engine got requests without pixels only when deferred"
    assert len(during) == 2 and during == pytest.approx(before, rel=1e-6, abs=1e-7)


def test_an_engine_that_reads_pixels_keeps_them_first(tmp_path, caplog):
    model, tok = build_tiny_model("vl", seed=0)
    pipe = Stage2Pipeline(PromptEncoder(tok, build_tiny_image_processor()))
    args = TrainingArguments(output_dir=str(tmp_path / "o"), max_steps=1, per_device_train_batch_size=1,
                             report_to=[], remove_unused_columns=False, use_cpu=True)
    hf = HFRolloutEngine(model, tok.pad_token_id, sorted(stop_token_ids(tok)), 1)
    with caplog.at_level("WARNING"):
        trainer = RolloutMatchingTrainer(model=model, args=args, train_dataset=SampleDataset([]), pipeline=pipe,
                                         engine=hf, processing_class=tok, settings=TrainerSettings(
                                             rollout=RolloutSettings(DecodingParams(max_new_tokens=4),
                                                                     pixels_during_decode=True)))
    assert not trainer.pixels_during_decode and "pixels are made before the decode" in caplog.text
