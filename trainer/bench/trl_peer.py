"""The peer of a benchmark table's ``trl: true`` variants (``benchmarks/scale.yaml``): TRL's ``GRPOTrainer`` with vLLM colocate on the same random Qwen3-VL model,
records (images), batch and generation length, in its own process (``python -m trainer.bench.trl_peer``).

TRL is what a user would pick instead of this project. Its step is timed the way ours is: whole ``training_step``
seconds (generation, weight sync, forward, backward: ``step_s``), with TRL's own profiling blocks (``sync_weights``,
``vLLM.generate``, ``compute_loss``) read from its ``ProfilingContext``; HF runs the optimizer step after
``training_step``, so it is timed apart as ours is (``optimizer_s``: the end of ``training_step`` to the callback's
``on_step_end``: clipping, ``optimizer.step()``, the scheduler, ``zero_grad``), and so is the wall time from one
optimizer step's end to the next (``step_wall_s``, the first from ``on_train_begin``: everything, the number the
runner compares with our ``time/step_wall_s``). Same work as ours: ``batch`` completions of
exactly ``max_new_tokens`` (random weights never stop), one optimizer step per batch, bf16, gradient checkpointing,
no KL term (``beta=0``: stage 2 has no reference model), vLLM sleep mode on. The reward is a constant: it does not
change the time of anything but the advantage arithmetic. Qwen3-VL's vision special tokens are kept out of TRL's
completions (``suppressed_tokens_kwargs``): a random model that samples one breaks TRL's forward.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trainer.telemetry import StepClock, install_step_clock


def records_dataset(jsonl: Path, instruction: str):
    """TRL's conversational VL format: ``prompt`` (one user turn: the image, then the instruction) and ``image``."""
    from datasets import Dataset
    from PIL import Image

    rows = []
    for line in jsonl.read_text().splitlines():
        rec = json.loads(line)
        image = Image.open(jsonl.parent / rec["images"][0]).convert("RGB")
        rows.append({"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": instruction}]}],
                     "image": image})
    return Dataset.from_list(rows)


#: Qwen3-VL's vision special tokens: a random model samples them now and then (8B on an H200, 2026-11-27: one
#: ``<|image_pad|>`` among 8 completions), and TRL's forward over prompt + completion then counts one image token
#: more than the images have features ("Image features and image tokens do not match, tokens: 8193, features: 8192")
VISION_SPECIAL_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


def vision_token_ids(tokenizer) -> list[int]:
    """The ids of ``VISION_SPECIAL_TOKENS`` the tokenizer knows (unknown ones left out)."""
    unk = tokenizer.unk_token_id
    ids = [tokenizer.convert_tokens_to_ids(t) for t in VISION_SPECIAL_TOKENS]
    return sorted({i for i in ids if isinstance(i, int) and i >= 0 and i != unk})


def suppressed_tokens_kwargs(token_ids: list[int], use_vllm: bool) -> dict[str, Any]:
    """TRL's ``generation_kwargs`` that keep ``token_ids`` out of the completions: vLLM's ``SamplingParams`` take a
    ``logit_bias`` of -100 per id, HF's ``GenerationConfig`` ``suppress_tokens``. Our side needs none: its targets are
    rebuilt from the parsed objects, so a stray vision token in a rollout never reaches the training forward."""
    if not token_ids:
        return {}
    return {"logit_bias": {i: -100.0 for i in token_ids}} if use_vllm else {"suppress_tokens": list(token_ids)}


def processor_for(model_dir: Path):
    """The Qwen3-VL processor over the model directory's tokenizer and image processor (what vLLM also loads)."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLProcessor

    from trainer.modeling.tokenizer import CHAT_TEMPLATE

    tok = AutoTokenizer.from_pretrained(model_dir)
    image_processor = AutoImageProcessor.from_pretrained(model_dir)
    try:
        from transformers import Qwen3VLVideoProcessor

        video = Qwen3VLVideoProcessor()
    except Exception:  # noqa: BLE001 - no torchvision (CPU machine): images only
        return _images_only_processor_class()(image_processor=image_processor, tokenizer=tok,
                                              chat_template=CHAT_TEMPLATE)
    return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tok, video_processor=video,
                            chat_template=CHAT_TEMPLATE)


def _images_only_processor_class():
    """``Qwen3VLProcessor`` without a video processor, for machines without torchvision (the CPU tests).

    transformers 5.19 checks every ``__init__`` sub-processor argument's class, ``video_processor=None`` included, and
    without torchvision its ``VideoProcessorMixin`` lookup fails (``VIDEO_PROCESSOR_MAPPING._extra_content``). The
    sub-processors are read off ``__init__``'s signature, so one without ``video_processor`` is checked on the image
    processor and tokenizer only; ``ProcessorMixin.__call__`` skips videos when there is no ``video_processor``."""
    from transformers import Qwen3VLProcessor

    class ImagesOnlyQwen3VLProcessor(Qwen3VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return ImagesOnlyQwen3VLProcessor


@contextmanager
def mm_token_types_into(module, mm_token_type_ids):
    """While open, every call of ``module`` (the Qwen3-VL ``model.model``) without ``mm_token_type_ids`` gets these:
    a forward pre-hook, removed on leaving; nothing when ``mm_token_type_ids`` is None."""
    if mm_token_type_ids is None:
        yield
        return

    def add(_module, args, kwargs):
        if kwargs.get("mm_token_type_ids") is None:
            return args, {**kwargs, "mm_token_type_ids": mm_token_type_ids}
        return None

    handle = module.register_forward_pre_hook(add, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def liger_decoder(unwrapped_model):
    """The module TRL's Liger loss path calls for the last hidden state (``GRPOTrainer._get_last_hidden_state``): the
    PEFT wrapper's base model, if any, then its ``.model`` (``Qwen3VLModel``, vision tower and language model)."""
    from accelerate.utils import is_peft_model

    base = unwrapped_model.base_model.model if is_peft_model(unwrapped_model) else unwrapped_model
    return base.model


def steady_mean(xs: list[float]) -> float:
    """Mean without the first step (CUDA-graph capture, compilation, first allocations), as the runner takes ours;
    a single step is its own mean."""
    xs = xs[1:] if len(xs) > 1 else xs
    return sum(xs) / len(xs) if xs else 0.0


def run(model_dir: Path, data: Path, out: Path, *, steps: int, batch: int, max_new_tokens: int, vllm_util: float,
        use_vllm: bool, lora_rank: int, liger: bool = False) -> dict[str, Any]:
    import torch
    import trl
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    from trainer.modeling.prompts import DEFAULT_INSTRUCTION

    blocks: dict[str, list[float]] = defaultdict(list)
    original = profiling.ProfilingContext._log_metrics

    def record(self, duration: float) -> None:
        blocks[self.name].append(duration)
        original(self, duration)

    profiling.ProfilingContext._log_metrics = record
    steps_s: list[float] = []
    #: per training_step: the prompt and completion tokens TRL's loss forward + backward ran over (the masks' sums),
    #: and the padded batch it ran them in (prompt + completion tensor sizes)
    prompt_tokens: list[int] = []
    completion_tokens: list[int] = []
    padded_tokens: list[int] = []
    peaks: list[float] = []
    optimizer_peaks: list[float] = []
    clock = StepClock()

    class TimedGRPOTrainer(GRPOTrainer):
        def training_step(self, *args, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            prompt_tokens.append(0)
            completion_tokens.append(0)
            padded_tokens.append(0)
            loss = super().training_step(*args, **kwargs)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                peaks.append(torch.cuda.max_memory_allocated() / 2**30)
            steps_s.append(time.perf_counter() - t0)
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()  # from here to on_step_end: the optimizer's peak
            clock.training_step_end()
            return loss

        def compute_loss(self, model, inputs, *args, **kwargs):
            prompt_tokens[-1] += int(inputs["prompt_mask"].sum())
            completion_tokens[-1] += int(inputs["completion_mask"].sum())
            padded_tokens[-1] += inputs["prompt_ids"].numel() + inputs["completion_ids"].numel()
            return super().compute_loss(model, inputs, *args, **kwargs)

        def compute_liger_loss(self, unwrapped_model, inputs):
            """TRL 0.29.1's Liger loss (``use_liger_kernel=True``) takes the last hidden state from
            ``_get_last_hidden_state``, which calls ``model.model`` with ``pixel_values`` and ``image_grid_thw`` but
            drops ``mm_token_type_ids``; Qwen3-VL in transformers >= 5.17 then refuses to build M-RoPE positions
            (ValueError: "Multimodal data was passed ... but `mm_token_type_ids` is missing"). The batch already
            holds them (the processor's, zeros over the completion, what TRL's non-Liger ``_compute_loss`` passes):
            this hands them to that one call and leaves the rest of TRL's step as it is."""
            with mm_token_types_into(liger_decoder(unwrapped_model), inputs.get("mm_token_type_ids")):
                return super().compute_liger_loss(unwrapped_model, inputs)

    def optimizer_peak(*_: float | None) -> None:
        if torch.cuda.is_available():
            optimizer_peaks.append(torch.cuda.max_memory_allocated() / 2**30)

    on_gpu = torch.cuda.is_available()
    processor = processor_for(model_dir)
    args = GRPOConfig(
        output_dir=str(out.parent / "trl-run"), max_steps=steps, per_device_train_batch_size=batch,
        num_generations=2, gradient_accumulation_steps=1, learning_rate=1e-5, beta=0.0, logging_steps=1,
        max_completion_length=max_new_tokens, temperature=1.0, bf16=on_gpu, gradient_checkpointing=True,
        report_to=[], save_strategy="no", use_vllm=use_vllm, vllm_mode="colocate",
        vllm_gpu_memory_utilization=vllm_util, vllm_enable_sleep_mode=use_vllm, vllm_max_model_length=4096,
        seed=0, dataloader_num_workers=0, remove_unused_columns=False, use_cpu=not on_gpu, use_liger_kernel=liger,
        generation_kwargs=suppressed_tokens_kwargs(vision_token_ids(processor.tokenizer), use_vllm))
    peft_config = None
    if lora_rank:
        from peft import LoraConfig

        peft_config = LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=["q_proj", "k_proj", "v_proj",
                                 "o_proj", "gate_proj", "up_proj", "down_proj"], task_type="CAUSAL_LM")
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.bfloat16 if on_gpu else torch.float32)
    model.model.visual.requires_grad_(False)  # as ours: freeze_vit / freeze_aligner default true
    trainer = TimedGRPOTrainer(model=model, args=args, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                               train_dataset=records_dataset(data, DEFAULT_INSTRUCTION),
                               processing_class=processor, peft_config=peft_config)
    install_step_clock(trainer, clock, optimizer_peak)
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    timed = slice(1, None) if len(steps_s) > 1 else slice(None)

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else 0.0

    result = {"trl": trl.__version__, "wall_s": wall, "steps": len(steps_s), "step_s_runs": steps_s,
              "step_s": steady_mean(steps_s), "step_wall_s_runs": clock.step_wall_s,
              "step_wall_s": steady_mean(clock.step_wall_s), "optimizer_s_runs": clock.optimizer_s,
              "optimizer_s": steady_mean(clock.optimizer_s), "peak_gib_runs": peaks,
              "optimizer_peak_gib_runs": optimizer_peaks,
              "blocks_s": {k: mean(v[timed] if len(v) == len(steps_s) else v) for k, v in blocks.items()},
              "blocks_s_runs": dict(blocks), "completions_per_step": batch, "max_new_tokens": max_new_tokens,
              "use_liger_kernel": liger, "prompt_tokens_runs": prompt_tokens,
              "completion_tokens_runs": completion_tokens, "padded_tokens_runs": padded_tokens,
              "train_tokens": steady_mean([float(a + b) for a, b in zip(prompt_tokens, completion_tokens)])}
    out.write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("data", type=Path, help="a JSONL of detection records (the synthetic set our side trained on)")
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=1536)
    ap.add_argument("--vllm-util", type=float, default=0.3)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--lora-rank", type=int, default=0)
    ap.add_argument("--liger", action="store_true", help="GRPOConfig(use_liger_kernel=True): Liger's fused GRPO loss")
    a = ap.parse_args(argv)
    res = run(a.model_dir, a.data, a.out, steps=a.steps, batch=a.batch, max_new_tokens=a.max_new_tokens,
              vllm_util=a.vllm_util, use_vllm=not a.no_vllm, lora_rank=a.lora_rank,
              liger=a.liger)
    print(json.dumps({k: res[k] for k in ("trl", "steps", "step_s", "step_wall_s", "optimizer_s", "blocks_s")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
