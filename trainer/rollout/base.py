"""The rollout-engine interface every backend implements (hf, vllm colocate, server client)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from trainer.rollout.types import DecodingParams, RolloutRequest, RolloutResult


@runtime_checkable
class RolloutEngine(Protocol):
    """Decode a list of requests; results in request order; ``generate([])`` returns ``[]``. An engine that decodes
    from the image files alone and never reads ``mm_inputs["pixel_values"]`` says so with ``reads_images = True``."""

    name: str

    def generate(self, requests: Sequence[RolloutRequest], params: DecodingParams) -> list[RolloutResult]: ...

    def close(self) -> None: ...
