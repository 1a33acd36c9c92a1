"""``model prepare`` at a small-but-real Qwen3-VL shape on a CUDA GPU with vLLM: a random stock checkpoint (bf16,
untied LM head as Qwen3-VL-8B, head_dim 128, the stock vocabulary's 267 spare rows as Qwen3-VL has) built in code
(no hub) is prepared; vLLM's in-process engine (the colocate backend) loads the prepared directory as it is, its
vocabulary holds the coord tokens, prompts with coord tokens are served as encoded, and coord tokens it generates
decode to their text. Then ``train`` runs stage 1 and stage 2 on it with vLLM colocate rollouts, and stage 1's
speed is recorded.

Run on the GPU machine: ``python -m pytest -m gpu tests/gpu/test_prepare_gpu.py`` (``RM_GPU_RESULTS=FILE`` collects
the measured values as JSON lines).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.gpu.gpu_results import record
from trainer.data.output_format import all_coord_tokens

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                                 reason="needs a CUDA GPU and vLLM")]

SPARE_ROWS = 267  # Qwen3-VL: 151936 embedding rows for a 151669-token tokenizer
TEXT = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=16,
            num_key_value_heads=8, head_dim=128, max_position_embeddings=4096, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20],
                             "mrope_interleaved": True})
VISION = dict(depth=2, hidden_size=256, intermediate_size=1024, num_heads=4, patch_size=16, spatial_merge_size=2,
              temporal_patch_size=2, out_hidden_size=1024, num_position_embeddings=2304, deepstack_visual_indexes=[1])


def save_stock_vl(out: Path) -> Path:
    """A random Qwen3-VL at the shape above with the embedded tokenizer minus the coord tokens, saved in bf16."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from trainer.modeling.fixtures import build_tiny_image_processor, tiny_tokenizer
    from trainer.modeling.tokenizer import IM_END, IMAGE_PAD, PAD_TOKEN, VIDEO_PAD, VISION_END, VISION_START

    tok = tiny_tokenizer(stock=True)
    ids = tok.convert_tokens_to_ids
    torch.manual_seed(0)
    cfg = Qwen3VLConfig(
        text_config={**TEXT, "vocab_size": len(tok) + SPARE_ROWS, "pad_token_id": ids(PAD_TOKEN),
                     "eos_token_id": ids(IM_END)},
        vision_config=VISION, image_token_id=ids(IMAGE_PAD), video_token_id=ids(VIDEO_PAD),
        vision_start_token_id=ids(VISION_START), vision_end_token_id=ids(VISION_END), tie_word_embeddings=False)
    model = Qwen3VLForConditionalGeneration(cfg).to(torch.bfloat16)
    model.generation_config.eos_token_id = ids(IM_END)
    model.generation_config.pad_token_id = ids(PAD_TOKEN)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    build_tiny_image_processor().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, dict]:
    from trainer.modeling.prepare import prepare_checkpoint

    root = tmp_path_factory.mktemp("from-stock")
    stock = save_stock_vl(root / "stock")
    t0 = time.perf_counter()
    result = prepare_checkpoint(stock, root / "prepared")
    seconds = time.perf_counter() - t0
    assert result.tokens_added == 1000 and not result.tied_embeddings
    assert result.rows_before == 800 + SPARE_ROWS and result.rows_after == 1800
    return root / "prepared", {"prepare_s": seconds}


def test_vllm_colocate_engine_serves_the_prepared_qwen3_vl(prepared):
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from trainer.modeling.coord_vocab import stop_token_ids
    from trainer.rollout.types import DecodingParams, RolloutRequest, check_prompt_alignment
    from trainer.rollout.vllm_colocate import VllmColocateEngine

    model_dir, info = prepared
    tok = AutoTokenizer.from_pretrained(model_dir)
    coord_ids = tok.convert_tokens_to_ids(all_coord_tokens())
    t0 = time.perf_counter()
    engine = VllmColocateEngine(model_dir, sorted(stop_token_ids(tok)), max_model_len=1024,
                                gpu_memory_utilization=0.15, dtype="bfloat16", engine_kwargs={"enforce_eager": True})
    start_s = time.perf_counter() - t0
    try:
        llm = engine.vllm.llm
        assert engine.vllm.multimodal, "the prepared Qwen3-VL must load as a multimodal model"
        assert llm.llm_engine.model_config.get_vocab_size() == 1800
        served = llm.get_tokenizer()
        assert served.convert_tokens_to_ids(all_coord_tokens()) == coord_ids
        requests = []
        for i, scene in enumerate(["red circle at <|coord_12|> <|coord_999|>", "two blue squares", "empty"]):
            msgs = ({"role": "user", "content": f"Detect every object.\nScene: {scene}"},)
            text = tok.apply_chat_template(list(msgs), tokenize=False, add_generation_prompt=True)
            requests.append(RolloutRequest(f"p{i}", msgs, tuple(tok(text, add_special_tokens=False)["input_ids"])))
        assert {coord_ids[12], coord_ids[999]} <= set(requests[0].prompt_token_ids)
        got = engine.generate(requests, DecodingParams(max_new_tokens=16))
        check_prompt_alignment(requests, got)
        assert all(r.response_token_ids for r in got)
        out = llm.generate([{"prompt_token_ids": list(requests[1].prompt_token_ids)}],
                           SamplingParams(max_tokens=8, temperature=0.0, allowed_token_ids=coord_ids))[0].outputs[0]
        assert len(out.token_ids) == 8 and set(out.token_ids) <= set(coord_ids)
        assert out.text == "".join(f"<|coord_{t - coord_ids[0]}|>" for t in out.token_ids)
    finally:
        engine.close()
    record("prepare_vllm_colocate", engine_start_s=start_s, coord_text=out.text, **info)


def test_train_stage1_then_stage2_with_vllm_colocate_on_the_prepared_model(prepared, tmp_path):
    """``python -m trainer train`` in a process of its own (a vLLM engine per process): stage 1 with the auto learning
    rate and bf16, stage 2 with colocate rollouts; stage 1's logged speed is recorded."""
    from trainer.telemetry import read_jsonl

    model_dir, _ = prepared
    config = tmp_path / "from_stock_gpu.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": str(model_dir), "torch_dtype": "bfloat16"},
        "data": {"synthetic": {"num_samples": 64, "seed": 0, "min_objects": 1, "max_objects": 3, "image_size": 64,
                               "eval_num_samples": 8}},
        "training": {"output_dir": str(tmp_path / "run"), "max_steps": 4, "per_device_train_batch_size": 8,
                     "learning_rate": 2e-4, "logging_steps": 1, "seed": 0, "disable_tqdm": True, "bf16": True,
                     "report_to": ["jsonl"], "packing": True, "packing_length": 4096},
        "stage1": {"steps": 20, "batch_size": 16, "logging_steps": 5},
        "custom": {"extra": {"rollout_matching": {
            "rollout_backend": "vllm", "rollout_generate_batch_size": 8,
            "decoding": {"max_new_tokens": 160, "temperature": 0.0},
            "matching": {"mask_iou_threshold": 0.3, "candidate_top_k": 3, "mask_resolution": 128},
            "vllm": {"mode": "colocate", "max_model_len": 2048, "enforce_eager": True,
                     "gpu_memory_utilization": 0.2}}}},
    }))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "trainer", "train", "--config", str(config)], capture_output=True,
                          text=True, timeout=900, env={**os.environ, "VLLM_PLUGINS": ""})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    stage1 = [r for r in rows if r.get("phase") == "stage1" and "loss" in r]
    stage2 = [r for r in rows if r.get("phase") == "stage2" and "loss" in r]
    assert len(stage1) == 4 and len(stage2) == 4
    assert all(r["learning_rate"] == 2e-5 for r in stage1), "auto: 73M parameters (50M-3B), full fine-tuning"
    assert all(r["loss"] == r["loss"] for r in stage1 + stage2), "finite losses"
    assert all(r["speed/steps_per_s"] > 0 for r in stage1)
    evals = [r for r in rows if r.get("phase") == "eval"]
    assert [r["step"] for r in evals] == [0, 4]
    record("prepare_train_stage1_stage2", seconds=time.perf_counter() - t0,
           stage1_steps_per_s=[r["speed/steps_per_s"] for r in stage1],
           stage1_step_s=[r.get("time/step_s") for r in stage1], stage1_losses=[r["loss"] for r in stage1],
           stage2_losses=[r["loss"] for r in stage2],
           parse_failure_rate=[r.get("eval/parse_failure_rate") for r in evals])
