"""The ``scripted`` engine: no model, deterministic, protocol-complete — the stub for integration tests.

- Prompts are encoded with the model directory's tokenizer when one is given (so prompt ids match what the
  learner encodes), else as the UTF-8 bytes of the canonical JSON of the messages (stop id 0).
- Responses: a replayed answer when the request's ``uuid`` (our sample id) is in ``responses`` (text, encoded
  and closed with the end-of-turn token, or token ids), else 1–8 ids drawn from a hash of (prompt ids,
  weights version) followed by a stop id. Decoding knobs other than ``max_new_tokens`` are ignored.
- Weight updates arrive on every transport and are recorded; the weights version (a digest of the last
  full and adapter updates) changes the hashed answers, so stale weights are observable.
- Full updates are checked as a real engine checks them (``trainer.sync.update_check``: names, shapes, dtype,
  finite values) before anything changes: against ``spec`` when given, else the model directory's checkpoint
  (its safetensors headers; ``dtype`` overrides the floating dtype), else the first accepted full update
  fixes the names, shapes and dtypes (only finite values are checked for that one). A refused update raises
  ``WeightUpdateRefused`` (HTTP 422) and leaves the weights version, answers and checksums unchanged.
  Adapters are checked for finite values.
- Fault injection: with ``die_after_calls`` N, every ``generate`` after the first N raises ``FatalEngineError``
  (a dead engine: the server answers 503 and exits, ``trainer.server.fatal``).
- ``world_size``: what ``/get_world_size/`` answers, tensor × data parallel of the server it stands in for
  (``serve --engine scripted --tensor-parallel-size T --data-parallel-size D``; 1 by default), as ``swift rollout``
  answers for its engines. Its NCCL receive is one rank, so NCCL weight updates need world size 1; the in-band
  transports take updates at any world size.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from trainer.rollout.types import DecodingParams, RolloutRequest, RolloutResult
from trainer.server.codec import EngineRequestError, PromptCodec, load_codec
from trainer.server.engines import LocalNcclMixin
from trainer.server.fatal import FatalEngineError
from trainer.server.protocol import RolloutInferRequestIn
from trainer.sync.update_check import (
    TensorSpec,
    WeightUpdateRefused,
    check_update,
    first_non_finite,
    spec_from_checkpoint,
    spec_from_state_dict,
)
from trainer.sync.weights import AdapterWeights, tensor_checksums


class ByteCodec:
    """Model-free codec: prompt = UTF-8 bytes of the messages' canonical JSON; id 0 stops."""

    stop_id = 0

    def encode(self, req: RolloutInferRequestIn, index: int) -> RolloutRequest:
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        data = json.dumps({"messages": messages, "images": req.images}, sort_keys=True).encode("utf-8")
        return RolloutRequest(req.uuid or str(index), tuple(messages), tuple(data), tuple(req.images))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 < i < 256).decode("utf-8", errors="replace")


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class ScriptedEngine(LocalNcclMixin):
    kind = "scripted"
    #: /infer/ with request_config.logprobs: 0.0 for every token (a scripted token is chosen with certainty), so a
    #: learner measuring its train-inference mismatch runs against the stub as against a real engine
    returns_logprobs = True
    world_size = 1

    def __init__(self, model_dir: str | Path | None = None, responses: dict[str, str | list[int]] | None = None,
                 delay_s: float = 0.0, enable_lora: bool = True, spec: dict[str, TensorSpec] | None = None,
                 dtype: torch.dtype | None = None, allow_dtype_cast: bool = False, die_after_calls: int | None = None,
                 world_size: int = 1):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.codec: PromptCodec | ByteCodec = load_codec(model_dir) if model_dir else ByteCodec()
        self.model_name = str(model_dir) if model_dir else "scripted"
        self.responses = dict(responses or {})
        self.delay_s = delay_s
        self.enable_lora = enable_lora
        if isinstance(self.codec, PromptCodec):
            from trainer.modeling.coord_vocab import stop_token_ids

            tok = self.codec.tokenizer
            self.stop_ids = sorted(stop_token_ids(tok))
            self.end_of_turn = tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else self.stop_ids[0]
            special = set(tok.all_special_ids)
            self.content_ids = [i for i in range(len(tok)) if i not in special and i not in self.stop_ids]
        else:
            self.stop_ids = [ByteCodec.stop_id]
            self.end_of_turn = ByteCodec.stop_id
            self.content_ids = list(range(32, 127))
        if spec is None and model_dir and any(Path(model_dir).glob("*.safetensors")):
            spec = spec_from_checkpoint(model_dir, dtype)
        self.spec = spec
        self.allow_dtype_cast = allow_dtype_cast
        self.checksums: dict[str, str] = {}
        self.full_version = "initial"
        self.adapter_version: str | None = None
        self.updates: list[dict[str, Any]] = []
        self.generate_calls = 0
        self.die_after_calls = die_after_calls

    @property
    def nccl_refusal(self) -> str | None:
        """Why ``/init_communicator/`` is refused (answered at once, before the learner joins the group), or None."""
        if self.world_size == 1:
            return None
        return (f"this scripted server reports world size {self.world_size} (--tensor-parallel-size x "
                "--data-parallel-size) but receives NCCL weight updates as one rank: serve it with world size 1 for "
                "NCCL syncs, or sync in band (sync.transport: inband)")

    def nccl_init(self, host: str, port: int, world_size: int, backend: str = "pynccl") -> None:
        if self.nccl_refusal:
            raise EngineRequestError(self.nccl_refusal)
        super().nccl_init(host, port, world_size, backend)

    @property
    def weights_version(self) -> str:
        return self.full_version if self.adapter_version is None else f"{self.full_version}+{self.adapter_version}"

    def encode(self, request: RolloutInferRequestIn, index: int) -> RolloutRequest:
        return self.codec.encode(request, index)

    def decode_text(self, ids: Sequence[int]) -> str:
        return self.codec.decode(ids)

    def _replayed(self, value: str | list[int]) -> list[int]:
        if isinstance(value, str):
            if not isinstance(self.codec, PromptCodec):
                raise ValueError("text responses need --model (a tokenizer); give token ids instead")
            return list(self.codec.tokenizer(value, add_special_tokens=False)["input_ids"]) + [self.end_of_turn]
        return list(value)

    def _hashed(self, prompt: Sequence[int]) -> list[int]:
        digest = hashlib.sha256(json.dumps([list(prompt), self.weights_version]).encode()).digest()
        rng = random.Random(int.from_bytes(digest[:8], "big"))
        return [rng.choice(self.content_ids) for _ in range(rng.randint(1, 8))] + [self.end_of_turn]

    def generate(self, requests: Sequence[RolloutRequest], params: DecodingParams) -> list[RolloutResult]:
        self.generate_calls += 1
        if self.die_after_calls is not None and self.generate_calls > self.die_after_calls:
            raise FatalEngineError(f"scripted engine died at generate call {self.generate_calls} (fault injection: "
                                   f"die_after_calls={self.die_after_calls})")
        if self.delay_s:
            time.sleep(self.delay_s)
        results = []
        for r in requests:
            ids = self._replayed(self.responses[r.sample_id]) if r.sample_id in self.responses else self._hashed(r.prompt_token_ids)
            cut = next((i + 1 for i, t in enumerate(ids) if t in self.stop_ids), None)
            ids = ids[:cut] if cut is not None else ids
            finish = "stop" if cut is not None and len(ids) <= params.max_new_tokens else "length"
            response = tuple(ids[:params.max_new_tokens])
            logprobs = None if params.logprobs is None else tuple({t: 0.0} for t in response)
            results.append(RolloutResult(r.sample_id, r.prompt_token_ids, response, finish,
                                         {"weights_version": self.weights_version}, logprobs=logprobs))
        return results

    def token_text(self, token_id: int) -> str:
        """One token as text (the ``token`` of a logprobs entry)."""
        if isinstance(self.codec, PromptCodec):
            return self.codec.token_text(token_id)
        return self.codec.decode([token_id])

    def _record(self, kind: str, tensors: dict[str, torch.Tensor]) -> str:
        digest = tensors_digest(tensors)
        self.updates.append({"kind": kind, "num_tensors": len(tensors), "digest": digest,
                             "bytes": sum(t.numel() * t.element_size() for t in tensors.values())})
        return digest[:16]

    def load_full(self, tensors: dict[str, torch.Tensor]) -> None:
        if self.spec is not None:
            check_update(tensors, self.spec, allow_cast=self.allow_dtype_cast)
        else:
            bad = first_non_finite(tensors)
            if bad is not None:
                raise WeightUpdateRefused(bad, "holds non-finite values (NaN or inf)")
            self.spec = spec_from_state_dict(tensors)
        self.full_version = self._record("full", tensors)
        self.checksums.update(tensor_checksums(tensors))
        self.adapter_version = None

    def load_adapter(self, adapter: AdapterWeights) -> None:
        if not self.enable_lora:
            raise ValueError("this scripted server was started without adapter support (--no-enable-lora)")
        bad = first_non_finite(adapter.tensors)
        if bad is not None:
            raise WeightUpdateRefused(bad, "holds non-finite values (NaN or inf)")
        self.adapter_version = self._record("adapter", adapter.tensors)
        self.updates[-1]["peft_config"] = adapter.peft_config

    def reset_prefix_cache(self) -> bool:
        return True

    def state_keys(self) -> list[str]:
        return []

    def weights_checksums(self) -> dict[str, str]:
        """``tensor_checksum`` of each weight received so far (the engine has no weights of its own)."""
        return dict(self.checksums)

    def close(self) -> None:
        self.nccl_close()
