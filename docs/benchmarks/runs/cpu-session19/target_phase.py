"""Where the learner's ``target`` phase goes at the layouts bench's shapes, on the CPU (no model forward): 64 records
of 1024² images with 40–80 objects, Qwen3-VL's 16 px patches and 2x2 merge, bf16 pixels, ground-truth targets (a
random model's rollouts parse to nothing, so every object is appended: the same target), packed into 16k rows with
mRoPE positions from Qwen3-VL's own ``get_rope_index``. Run from the repository root:
    .venv/bin/python docs/benchmarks/runs/cpu-session19/target_phase.py [--profile]"""

import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoImageProcessor

from trainer.bench.scale import save_random_vl_model
from trainer.data.records import load_jsonl
from trainer.data.synthetic import generate
from trainer.modeling.fixtures import tiny_tokenizer
from trainer.modeling.prompts import PromptEncoder
from trainer.packing.buffer import PackingBuffer
from trainer.packing.packed_batch import pack_targets
from trainer.sft.stage2 import Stage2Pipeline

work = Path(tempfile.mkdtemp(prefix="target-phase-"))
model_dir, _ = save_random_vl_model(work / "model", "tiny", "cpu")
from transformers import Qwen3VLForConditionalGeneration  # noqa: E402

model = Qwen3VLForConditionalGeneration.from_pretrained(model_dir)
samples = load_jsonl(generate(work / "data", 64, seed=0, image_size=1024, min_objects=40, max_objects=80))
pipe = Stage2Pipeline(PromptEncoder(tiny_tokenizer(), AutoImageProcessor.from_pretrained(model_dir),
                                    pixel_dtype=torch.bfloat16))
t0 = time.perf_counter()
targets = pipe.ground_truth_targets(samples)
t_targets = time.perf_counter() - t0
print(f"encode + ground-truth targets of 64 records: {t_targets:.2f} s; tokens {sum(t.length for t in targets)}")


def pack_all():
    buf = PackingBuffer(16384, 64)
    buf.add(targets)
    groups, stats = buf.pop_rows(buf.rows_needed())
    return [pack_targets(g, "flash_attention_2", model, model.config.image_token_id) for g in groups], stats, groups


pack_all()  # the rule is checked against the model's get_rope_index here, then trusted
t0 = time.perf_counter()
rows, stats, groups = pack_all()
print(f"packing {len(rows)} rows ({stats.segments} segments, {stats.tokens} tokens): {time.perf_counter() - t0:.3f} s")

# side by side, same process: the model's own get_rope_index against the rule, the per-token loss-index loop against
# the vectorised one, three rounds each over the same rows
sys.path.insert(0, str(Path("tests/unit").resolve()))
from test_mrope import _reference_loss_indices  # noqa: E402

from trainer.packing.batching import loss_indices  # noqa: E402
from trainer.packing.mrope import SegmentPositions  # noqa: E402
from trainer.packing.packed_batch import SEGMENT_POSITIONS  # noqa: E402

owner = model.model
image = model.config.image_token_id


def timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


for name, fn in (("get_rope_index (before)", lambda t: SegmentPositions.models_own(
                     owner, t.input_ids, t.mm_inputs.get("image_grid_thw"), image)),
                 ("image rule (after)", lambda t: SEGMENT_POSITIONS(
                     model, t.input_ids, t.mm_inputs.get("image_grid_thw"), image))):
    best = min(timed(lambda fn=fn: [fn(t) for g in groups for t in g]) for _ in range(3))
    print(f"mRoPE positions of {stats.segments} segments, {name}: {best:.3f} s")
for name, fn in (("per-token loop (before)", _reference_loss_indices), ("vectorised (after)", loss_indices)):
    def run(fn=fn):
        for g in groups:
            fn(g, [0] * len(g), [sum(t.length for t in g[:i]) for i in range(len(g))])
    best = min(timed(run) for _ in range(3))
    print(f"loss indices of {len(groups)} rows, {name}: {best:.3f} s")
# build_target of the 64 records from random 1,536-token rollouts (nothing parses: every object is appended, as in
# the bench's random-model runs): the desc-span test per token by a scan of every span (before) or a binary search
import random  # noqa: E402

import trainer.matching.targets as targets_module  # noqa: E402
from trainer.rollout.types import RolloutResult  # noqa: E402
from trainer.telemetry import PhaseTimers  # noqa: E402

requests, _ = pipe.requests(samples, pixels=False)
rng = random.Random(0)
vocab = len(pipe.tokenizer)
results = [RolloutResult(r.sample_id, r.prompt_token_ids, tuple(rng.randrange(vocab) for _ in range(1536)), "length",
                         {}) for r in requests]
bisected = targets_module.overlaps_any
for name, overlaps in (("scan of every span (before)", lambda offsets, spans: [
                           any(a < e and b > s for s, e in spans) for a, b in offsets]),
                       ("binary search (after)", bisected)):
    targets_module.overlaps_any = overlaps
    best = float("inf")
    for _ in range(3):
        timers = PhaseTimers()
        pipe.targets(samples, requests, results, timers)
        best = min(best, timers.seconds["build_target"])
    print(f"build_target of 64 records (all objects appended), {name}: {best:.3f} s")
targets_module.overlaps_any = bisected
if "--profile" in sys.argv:
    prof = cProfile.Profile()
    prof.enable()
    pack_all()
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(18)
