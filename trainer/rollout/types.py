"""Typed rollout request/result exchanged between the trainer and every rollout backend.

Invariants:
- ``RolloutResult.prompt_token_ids`` is what the backend actually fed the model; the trainer
  compares it to the prompt it encoded itself (``check_prompt_alignment``).
- ``response_token_ids`` is stop-trimmed: it ends at (and includes) the first stop/EOS token, or at
  ``max_new_tokens`` when decoding was truncated (``finish_reason == "length"``).
- Backends return results in request order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class DecodingParams:
    """Decoding knobs shared by every backend (greedy when ``temperature == 0``)."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    seed: int | None = None
    #: None: no log-probabilities; k >= 0: each new token's log-probability and the k most likely alternatives'
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class RolloutRequest:
    """One prompt to decode.

    ``messages`` is the chat (system/user turns) in OpenAI/ms-swift form; ``images`` are strings
    (paths, URLs or base64) as in ms-swift's ``RolloutInferRequest``; ``prompt_token_ids`` is the
    prompt encoded by our template (with image placeholder tokens expanded), used for the strict
    alignment check and by backends that take token ids directly.
    """

    sample_id: str
    messages: tuple[dict[str, Any], ...]
    prompt_token_ids: tuple[int, ...]
    images: tuple[str, ...] = ()
    mm_inputs: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def to_infer_request(self) -> dict[str, Any]:
        """JSON-serialisable ms-swift ``RolloutInferRequest`` payload (images as strings)."""
        return {"messages": [dict(m) for m in self.messages], "images": list(self.images)}


@dataclass(frozen=True)
class RolloutResult:
    """Decoded tokens for one request."""

    sample_id: str
    prompt_token_ids: tuple[int, ...]
    response_token_ids: tuple[int, ...]
    finish_reason: Literal["stop", "length"] = "stop"
    extra: dict[str, Any] = field(default_factory=dict)
    #: with ``DecodingParams.logprobs``: per new token, {token id: log-probability} holding the sampled token and the
    #: requested alternatives (as the sampler saw them: after temperature and penalties)
    logprobs: tuple[dict[int, float], ...] | None = None

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


class PromptAlignmentError(RuntimeError):
    """The backend's prompt ids differ from the prompt the trainer encoded."""


def check_prompt_alignment(requests: Sequence[RolloutRequest], results: Sequence[RolloutResult]) -> None:
    """Raise ``PromptAlignmentError`` unless results match requests one-to-one with equal prompt ids."""
    if len(requests) != len(results):
        raise PromptAlignmentError(
            f"backend returned {len(results)} results for {len(requests)} requests; results must be 1:1 and in order"
        )
    for req, res in zip(requests, results):
        if req.sample_id != res.sample_id:
            raise PromptAlignmentError(
                f"result order broken: expected sample {req.sample_id!r}, got {res.sample_id!r}"
            )
        if tuple(req.prompt_token_ids) != tuple(res.prompt_token_ids):
            first = next(
                (i for i, (a, b) in enumerate(zip(req.prompt_token_ids, res.prompt_token_ids)) if a != b),
                min(len(req.prompt_token_ids), len(res.prompt_token_ids)),
            )
            raise PromptAlignmentError(
                f"sample {req.sample_id!r}: backend prompt ids differ from the encoded prompt at position {first} "
                f"(encoded len {len(req.prompt_token_ids)}, backend len {len(res.prompt_token_ids)}). "
                "The rollout backend must use the same chat template and image-token expansion as the training forward."
            )
