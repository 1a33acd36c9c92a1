"""One Qwen3-VL text decoder layer wrapped as a text model that ``trainer.modeling.compile.decoder_layers`` finds, with
the packed varlen op as its attention and the mRoPE rotary of its config: what the activation memory budget tests
compile (``tests/unit/test_compile_memory_budget.py`` on the CPU, ``tests/gpu/test_memory_budget_gpu.py`` on CUDA)."""

from __future__ import annotations

import torch

from trainer.packing.varlen_attention import register_varlen_attention


class OneLayer(torch.nn.Module):
    def __init__(self, config):
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextDecoderLayer

        super().__init__()
        self.config = config
        self.layers = torch.nn.ModuleList([Qwen3VLTextDecoderLayer(config, 0)])

    def get_decoder(self):
        return self


def one_layer(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, mrope_section: list[int],
              tokens: int, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0):
    """``(model, x, (cos, sin))``: the layer (seeded), an input row of ``tokens`` that requires grad, and its rotary."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    cfg = Qwen3VLTextConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=1,
                            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=64,
                            rope_scaling={"rope_type": "default", "mrope_section": mrope_section,
                                          "mrope_interleaved": True})
    cfg._attn_implementation = register_varlen_attention("op")
    torch.manual_seed(seed)
    model = OneLayer(cfg).to(device, dtype)
    x = torch.randn(1, tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    positions = torch.arange(tokens, device=device)[None].expand(3, 1, tokens)
    cos, sin = Qwen3VLTextRotaryEmbedding(cfg).to(device)(x, positions)
    return model, x, (cos, sin)
