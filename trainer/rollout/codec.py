"""The engine-independent ends of a rollout: samples → ``RolloutRequest`` (the chat template, images expanded) and
``RolloutResult`` → parsed objects (the strict training parser).

Shared by stage 2 (``trainer.sft.stage2.Stage2Pipeline`` adds matching and targets on top) and held-out evaluation
(``trainer.evaluation.run``), so both encode prompts and read responses the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainer.data.records import Sample
from trainer.matching.parse import ParseResult, parse_rollout
from trainer.modeling.coord_vocab import build_parse_vocab
from trainer.modeling.prompts import EncodedPrompt, PromptEncoder
from trainer.rollout.types import RolloutRequest, RolloutResult


class RolloutCodec:
    def __init__(self, encoder: PromptEncoder):
        self.encoder = encoder
        self.tokenizer = encoder.tokenizer
        self.vocab = build_parse_vocab(self.tokenizer)

    def requests(self, samples: Sequence[Sample]) -> tuple[list[RolloutRequest], list[EncodedPrompt]]:
        encoded = [self.encoder.encode(s) for s in samples]
        reqs = [
            RolloutRequest(s.sample_id, tuple(e.messages), tuple(e.input_ids), tuple(e.images), dict(e.mm_inputs))
            for s, e in zip(samples, encoded)
        ]
        return reqs, encoded

    def parse(self, result: RolloutResult) -> ParseResult:
        return parse_rollout(result.response_token_ids, self.vocab)
