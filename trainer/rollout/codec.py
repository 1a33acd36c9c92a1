"""The engine-independent ends of a rollout: samples → ``RolloutRequest`` (the chat template, images expanded) and
``RolloutResult`` → parsed objects (the strict training parser).

Shared by stage 2 (``trainer.sft.stage2.Stage2Pipeline`` adds matching and targets on top) and held-out evaluation
(``trainer.evaluation.run``), so both encode prompts and read responses the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from trainer.data.records import DatasetError, Sample
from trainer.matching.parse import ParseResult, parse_rollout
from trainer.modeling.coord_vocab import build_parse_vocab
from trainer.modeling.prompts import EncodedPrompt, PromptEncoder
from trainer.rollout.types import RolloutRequest, RolloutResult


class RolloutCodec:
    def __init__(self, encoder: PromptEncoder):
        self.encoder = encoder
        self.tokenizer = encoder.tokenizer
        self.vocab = build_parse_vocab(self.tokenizer)

    def requests(self, samples: Sequence[Sample], pixels: bool = True
                 ) -> tuple[list[RolloutRequest], list[EncodedPrompt]]:
        """``pixels=False``: the requests without ``pixel_values`` (``with_pixels`` adds them), for an engine that
        reads the images itself (``RolloutEngine.reads_images``)."""
        encoded = [self.encoder.encode(s, pixels=pixels) for s in samples]
        reqs = [
            RolloutRequest(s.sample_id, tuple(e.messages), tuple(e.input_ids), tuple(e.images), dict(e.mm_inputs))
            for s, e in zip(samples, encoded)
        ]
        return reqs, encoded

    def with_pixels(self, samples: Sequence[Sample], requests: Sequence[RolloutRequest]) -> list[RolloutRequest]:
        """``requests`` (from ``requests(pixels=False)``) with their pixel values. Each image's grid must be the one
        its prompt ids were expanded for (``DatasetError`` naming the sample otherwise). Uses the image processor
        only, so it may run on another thread while the tokenizer is in use."""
        out = []
        for sample, req in zip(samples, requests, strict=True):
            if not sample.images or "pixel_values" in req.mm_inputs:
                out.append(req)
                continue
            mm = self.encoder.pixels(sample)
            planned = req.mm_inputs.get("image_grid_thw")
            if planned is None or not torch.equal(mm["image_grid_thw"], planned):
                raise DatasetError(f"sample {sample.sample_id!r}: the image processor made a {mm['image_grid_thw'].tolist()} "
                                   f"patch grid, but the prompt was built for {None if planned is None else planned.tolist()} "
                                   f"from the record's {sample.width}x{sample.height}; run `python -m trainer data check`")
            out.append(replace(req, mm_inputs=mm))
        return out

    def parse(self, result: RolloutResult) -> ParseResult:
        return parse_rollout(result.response_token_ids, self.vocab)
