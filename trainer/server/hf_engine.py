"""The ``hf`` server engine: transformers ``generate`` on the served model (CPU or one GPU); full-weight
updates only (no adapter serving). Every update is checked against the served state dict (names, shapes, dtype,
finite values; ``trainer.sync.update_check``) before any weight changes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from trainer.rollout.types import DecodingParams, RolloutRequest, RolloutResult
from trainer.server.codec import EngineRequestError, load_codec
from trainer.server.engines import LocalNcclMixin
from trainer.server.protocol import RolloutInferRequestIn
from trainer.sync.update_check import check_update, spec_from_state_dict
from trainer.sync.weights import AdapterWeights


class HFServerEngine(LocalNcclMixin):
    kind = "hf"
    returns_logprobs = True  # /infer/ with request_config.logprobs: per-token log-probabilities, as sampled
    world_size = 1
    enable_lora = False

    def __init__(self, model_dir: str | Path, batch_size: int = 8, dtype: str = "float32", device: str | None = None,
                 allow_dtype_cast: bool = False):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        from trainer.modeling.coord_vocab import stop_token_ids
        from trainer.modeling.loading import VL_MODEL_TYPES
        from trainer.rollout.hf import HFRolloutEngine

        self.model_name = str(model_dir)
        self.codec = load_codec(model_dir)
        vl = AutoConfig.from_pretrained(model_dir).model_type in VL_MODEL_TYPES
        cls = AutoModelForImageTextToText if vl else AutoModelForCausalLM
        self.model = cls.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        if device:
            self.model.to(device)
        self.weights_device = next(self.model.parameters()).device
        self.allow_dtype_cast = allow_dtype_cast
        self.spec = spec_from_state_dict(self.model.state_dict())
        tok = self.codec.tokenizer
        self.rollout = HFRolloutEngine(self.model, tok.pad_token_id, sorted(stop_token_ids(tok)), batch_size,
                                       getattr(self.model.config, "image_token_id", None))

    def encode(self, request: RolloutInferRequestIn, index: int) -> RolloutRequest:
        return self.codec.encode(request, index)

    def decode_text(self, ids: Sequence[int]) -> str:
        return self.codec.decode(ids)

    def token_text(self, token_id: int) -> str:
        return self.codec.token_text(token_id)

    def generate(self, requests: Sequence[RolloutRequest], params: DecodingParams) -> list[RolloutResult]:
        return self.rollout.generate(requests, params)

    @torch.no_grad()
    def load_full(self, tensors: dict[str, torch.Tensor]) -> None:
        """Check the whole update (``WeightUpdateRefused`` → HTTP 422, nothing changed), then copy it in."""
        check_update(tensors, self.spec, allow_cast=self.allow_dtype_cast)
        state = self.model.state_dict()
        for name, value in tensors.items():
            state[name].copy_(value)  # same dtype, or a floating cast allowed by --allow-dtype-cast

    def load_adapter(self, adapter: AdapterWeights) -> None:
        raise EngineRequestError("the hf engine does not serve LoRA adapters; sync merged weights (sync.mode: full)")

    def reset_prefix_cache(self) -> bool:
        return True

    def state_keys(self) -> list[str]:
        return list(self.model.state_dict())

    def weights_checksums(self) -> dict[str, str]:
        from trainer.sync.weights import tensor_checksums

        return tensor_checksums(self.model.state_dict())

    def close(self) -> None:
        self.nccl_close()
