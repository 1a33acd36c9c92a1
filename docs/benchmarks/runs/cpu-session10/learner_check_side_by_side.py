import time, statistics, torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from peft import LoraConfig, get_peft_model
from trainer.sync.update_check import check_learner_weights, first_non_finite, _local_tensor
torch.manual_seed(0)
m = Qwen3ForCausalLM(Qwen3Config(vocab_size=32000, hidden_size=2048, intermediate_size=6144, num_hidden_layers=8,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128)).to(torch.bfloat16)
m = get_peft_model(m, LoraConfig(r=64, target_modules="all-linear"))
frozen = sum(p.numel() * p.element_size() for p in m.parameters() if not p.requires_grad)
train = sum(p.numel() * p.element_size() for p in m.parameters() if p.requires_grad)
print(f"frozen {frozen/1e9:.2f} GB, trainable {train/1e9:.3f} GB, params {sum(1 for _ in m.parameters())}")
def old():
    first_non_finite({n: _local_tensor(p).detach() for n, p in m.named_parameters()})
check_learner_weights(m, 0)
res = {"before (every parameter)": [], "after (trainable + changed frozen)": []}
for _ in range(7):
    for name, f in (("before (every parameter)", old), ("after (trainable + changed frozen)", lambda: check_learner_weights(m, 1))):
        t0 = time.perf_counter(); f(); res[name].append(time.perf_counter() - t0)
for k, v in res.items():
    print(f"{k}: median {statistics.median(v)*1e3:.1f} ms  (all: {', '.join(f'{x*1e3:.1f}' for x in v)})")
