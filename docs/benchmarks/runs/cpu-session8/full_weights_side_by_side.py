# Host-side work of full_weights before (4315eec, saved as /tmp/weights_old.py by
# `git show 4315eec:trainer/sync/weights.py > /tmp/weights_old.py`) and after the plan fast path, alternating in one process.
import importlib.util, statistics, time, sys, torch
sys.path.insert(0, "/tmp")
import weights_old
from trainer.sync import weights as weights_new
from peft import LoraConfig, get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM
torch.manual_seed(0)
cfg = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=80, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
pm = get_peft_model(Qwen3ForCausalLM(cfg), LoraConfig(r=8, target_modules="all-linear"))
plain = Qwen3ForCausalLM(cfg)
res = {}
for label, model in (("lora-merged", pm), ("plain", plain)):
    for mod in (weights_old, weights_new):
        mod.full_weights(model)
    times = {"old": [], "new": []}
    for _ in range(15):
        for name, mod in (("old", weights_old), ("new", weights_new)):
            t = time.perf_counter(); out = mod.full_weights(model); times[name].append(time.perf_counter() - t)
    a, b = weights_old.full_weights(model), weights_new.full_weights(model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    print(label, len(a), "tensors;", {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()}, "ms median of 15, alternating")
