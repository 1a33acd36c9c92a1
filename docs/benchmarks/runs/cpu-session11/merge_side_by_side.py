# The LoRA merge of full_weights before (567599a: weights stacked, upcast to float32, baddbmm, rounded back; kept as
# merge_precision float32) and with merge_precision weight_dtype (one bf16 addmm per layer onto the weight),
# alternating in one process. Saved old module: `git show 567599a:trainer/sync/weights.py > /tmp/weights_old.py`.
# Model: Qwen3-VL-8B's text widths (4096 / 12288, 32 q / 8 kv heads of 128), LAYERS decoder layers, bf16, all-linear
# LoRA r=64 with float32 factors carrying float32 precision (as after training).
import os, statistics, sys, time
import torch
sys.path.insert(0, "/tmp")
import weights_old
from trainer.bench.lora_merge import compare, lora_decoder
from trainer.bench.scale import QWEN3_VL_TEXT
from trainer.sync import weights as weights_new

layers, repeats = int(os.environ.get("LAYERS", "4")), int(os.environ.get("REPEATS", "5"))
model = lora_decoder({**QWEN3_VL_TEXT["8b"], "num_hidden_layers": layers}, "cpu", 64)
from peft.tuners.lora import LoraLayer

variants = {"old (567599a)": lambda: weights_old.full_weights(model),
            "new float32": lambda: weights_new.full_weights(model, merge_precision="float32"),
            "new weight_dtype": lambda: weights_new.full_weights(model, merge_precision="weight_dtype")}
outs = {k: f() for k, f in variants.items()}  # warm-up, kept for the comparison
adapted = [n.removeprefix("base_model.model.") + ".weight" for n, m in model.named_modules() if isinstance(m, LoraLayer)]
times = {k: [] for k in variants}
for _ in range(repeats):
    for k, f in variants.items():
        t = time.perf_counter(); f(); times[k].append(time.perf_counter() - t)
print(f"{layers} layers of the 8B widths, {torch.get_num_threads()} threads, torch {torch.__version__}; medians of {repeats}, alternating:")
for k, v in times.items():
    print(f"  {k:18s} {statistics.median(v) * 1e3:8.1f} ms  (all: {[round(x * 1e3) for x in v]})")
old, f32, wd = outs["old (567599a)"], outs["new float32"], outs["new weight_dtype"]
print("new float32 vs old:", compare(f32, old, adapted))
print("new weight_dtype vs old:", compare(wd, old, adapted))
print(f"adapted weights compared: {len(adapted)}")
