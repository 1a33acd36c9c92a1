"""HF ``generate`` rollout backend: microbatched (padded, left padding), no grad, stop-trimmed.

Speed knobs (``custom.extra.rollout_matching.hf``):

- ``cache_implementation``: ``dynamic`` (HF default, grows per step) or ``static`` (preallocated
  ``[batch, max_len]`` KV cache, fixed shapes per decoding step).
- ``compile``: ``torch.compile`` the decoding forward (HF compiles the per-token step, not the prefill). Needs
  the static cache (fixed shapes); otherwise HF would keep recompiling. Without ``compile`` the static cache is
  used eagerly (HF's automatic compile on CUDA is switched off so the knob means what it says).
- ``prompt_pad_multiple``: left-pad every microbatch's prompt width up to a multiple of this, and with
  ``compile`` the last partial microbatch is filled to ``batch_size`` with copies of its first request (their
  results are dropped). Both keep the number of distinct shapes (and so recompiles) small.

Greedy results do not depend on these knobs: extra left padding is masked, and rows of a batch are independent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from trainer.precision import autocast_for
from trainer.rollout.types import DecodingParams, RolloutRequest, RolloutResult

CACHE_IMPLEMENTATIONS = ("dynamic", "static")


def token_logprobs(scores: Sequence[torch.Tensor], row: int, tokens: Sequence[int], top: int) -> tuple[dict[int, float], ...]:
    """Per generated token of batch row ``row``: {id: log-probability} of the sampled token and the ``top`` most
    likely, from ``generate``'s per-step processed ``scores`` ([batch, vocab] each)."""
    out = []
    for step, token in enumerate(tokens):
        lp = torch.log_softmax(scores[step][row].float(), dim=-1)
        entry = {int(token): float(lp[token])}
        if top:
            values, ids = lp.topk(top)
            entry.update({int(k): float(v) for k, v in zip(ids.tolist(), values.tolist())})
        out.append(entry)
    return tuple(out)


class HFRolloutEngine:
    """Decodes with the training model itself (``rollout_backend: hf``).

    ``generate`` runs ``ceil(N / batch_size)`` padded ``model.generate`` calls; each result's response ends at
    (and includes) the first stop id, or is cut at ``max_new_tokens`` (``finish_reason='length'``).
    """

    name = "hf"

    def __init__(self, model: torch.nn.Module, pad_id: int, stop_ids: Sequence[int], batch_size: int = 1,
                 image_token_id: int | None = None, *, cache_implementation: str = "dynamic",
                 compile: bool = False, compile_mode: str | None = "reduce-overhead",
                 compile_backend: str = "inductor", prompt_pad_multiple: int = 1):
        if batch_size < 1:
            raise ValueError("rollout_generate_batch_size must be >= 1")
        if cache_implementation not in CACHE_IMPLEMENTATIONS:
            raise ValueError(f"hf.cache_implementation must be one of {CACHE_IMPLEMENTATIONS}, "
                             f"got {cache_implementation!r}")
        if compile and cache_implementation != "static":
            raise ValueError("hf.compile needs hf.cache_implementation: static (compiled decoding needs fixed "
                             "shapes; with the dynamic cache every step would recompile)")
        if prompt_pad_multiple < 1:
            raise ValueError("hf.prompt_pad_multiple must be >= 1")
        self.model = model
        self.pad_id = pad_id
        self.stop_ids = frozenset(stop_ids)
        self.batch_size = batch_size
        self.image_token_id = image_token_id
        self.cache_implementation = cache_implementation
        self.compile = compile
        self.compile_mode = compile_mode
        self.compile_backend = compile_backend
        self.prompt_pad_multiple = prompt_pad_multiple
        self._compile_config: Any = None
        if cache_implementation == "static":
            self._check_static_cache_support()

    def _check_static_cache_support(self) -> None:
        """Fail at construction, not mid-training: HF silently ignores ``cache_implementation`` for models without
        ``Cache`` support, and compiled decoding needs a model that compiles without graph breaks."""
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        name = type(base).__name__
        supports_cache = getattr(base, "_supports_default_dynamic_cache", None)
        if supports_cache is not None and not supports_cache():
            raise ValueError(f"hf.cache_implementation: static is not supported by {name} (no Cache support in this "
                             "transformers version); use hf.cache_implementation: dynamic")
        if self.compile and not getattr(base, "_can_compile_fullgraph", False):
            raise ValueError(f"hf.compile is not supported by {name} in this transformers version "
                             "(_can_compile_fullgraph is False); set hf.compile: false (the static cache still works)")

    def metadata(self) -> dict[str, Any]:
        return {"backend": "hf", "batch_size": self.batch_size, "cache_implementation": self.cache_implementation,
                "compile": self.compile, "compile_mode": self.compile_mode if self.compile else None,
                "prompt_pad_multiple": self.prompt_pad_multiple}

    def _batch_inputs(self, requests: Sequence[RolloutRequest], device: torch.device) -> dict[str, torch.Tensor]:
        width = max(len(r.prompt_token_ids) for r in requests)
        width = -(-width // self.prompt_pad_multiple) * self.prompt_pad_multiple
        ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for i, r in enumerate(requests):
            n = len(r.prompt_token_ids)
            ids[i, width - n:] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
            mask[i, width - n:] = 1
        batch: dict[str, torch.Tensor] = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
        if any(r.mm_inputs for r in requests):
            batch["pixel_values"] = torch.cat([r.mm_inputs["pixel_values"] for r in requests if r.mm_inputs]).to(device)
            batch["image_grid_thw"] = torch.cat([r.mm_inputs["image_grid_thw"] for r in requests if r.mm_inputs]).to(device)
            if self.image_token_id is not None:
                batch["mm_token_type_ids"] = (batch["input_ids"] == self.image_token_id).long() * batch["attention_mask"]
        return batch

    def _cache_kwargs(self) -> dict[str, Any]:
        if self.cache_implementation == "dynamic":
            return {}
        kwargs: dict[str, Any] = {"cache_implementation": "static"}
        if not self.compile:
            kwargs["disable_compile"] = True
            return kwargs
        if self._compile_config is None:
            from transformers.generation import CompileConfig

            # dynamic=False: one graph per (batch, cache length); the fixed shapes keep that number small.
            self._compile_config = CompileConfig(fullgraph=False, dynamic=False, backend=self.compile_backend,
                                                 mode=self.compile_mode if self.compile_backend == "inductor" else None)
            self._compile_config._compile_all_devices = True  # HF compiles on CUDA only by default; the knob is explicit
        kwargs.update(compile_config=self._compile_config, disable_compile=False)
        return kwargs

    def _generate_batch(self, requests: Sequence[RolloutRequest], params: DecodingParams) -> list[RolloutResult]:
        device = next(self.model.parameters()).device
        real = len(requests)
        if self.compile and real < self.batch_size:
            requests = list(requests) + [requests[0]] * (self.batch_size - real)
        batch = self._batch_inputs(requests, device)
        kwargs = dict(max_new_tokens=params.max_new_tokens, pad_token_id=self.pad_id,
                      eos_token_id=sorted(self.stop_ids), repetition_penalty=params.repetition_penalty,
                      **self._cache_kwargs())
        if params.greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(do_sample=True, temperature=params.temperature, top_p=params.top_p,
                          top_k=params.top_k if params.top_k > 0 else None)
        scores = None
        if params.logprobs is not None:  # the processed scores (penalty, temperature, top-k/p applied): as sampled
            kwargs.update(output_scores=True, return_dict_in_generate=True)
        with autocast_for(self.model, device.type):
            out = self.model.generate(**batch, **kwargs)
        if params.logprobs is not None:
            out, scores = out.sequences, out.scores
        width = batch["input_ids"].shape[1]
        results = []
        for i, r in enumerate(requests[:real]):
            prompt = batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
            response: list[int] = []
            finish = "length"
            for t in out[i, width:].tolist():
                response.append(t)
                if t in self.stop_ids:
                    finish = "stop"
                    break
            logprobs = None if scores is None else token_logprobs(scores, i, response, params.logprobs or 0)
            results.append(RolloutResult(r.sample_id, tuple(prompt), tuple(response), finish, logprobs=logprobs))
        return results

    @torch.no_grad()
    def generate(self, requests: Sequence[RolloutRequest], params: DecodingParams) -> list[RolloutResult]:
        if not requests:
            return []
        was_training = self.model.training
        self.model.eval()
        seeded = contextlib.nullcontext()
        if params.seed is not None and not params.greedy:
            # the decode draws from its own seeded stream; the training RNG (CPU and the model's GPU: dropout, data
            # order) continues afterwards as if the decode had not run
            device = next(self.model.parameters()).device
            seeded = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
        try:
            with seeded:
                if params.seed is not None and not params.greedy:
                    torch.manual_seed(params.seed)
                results: list[RolloutResult] = []
                for start in range(0, len(requests), self.batch_size):
                    results.extend(self._generate_batch(requests[start:start + self.batch_size], params))
                return results
        finally:
            self.model.train(was_training)

    def close(self) -> None:
        return None
