"""Model shapes the benchmarks build with random weights (``Qwen3Config`` keyword arguments)."""

QWEN3_0_6B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  intermediate_size=3072, vocab_size=151936)
