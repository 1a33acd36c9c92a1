"""The stage-2 data path without a model: samples → rollout requests; rollouts → parse → match → targets.

``Stage2Pipeline`` holds the tokenizer-derived tables and the matching/poly config; every method is
deterministic given its inputs. Side effects (generation, GPU) stay in the trainer. Requests and parsing come from
``trainer.rollout.codec.RolloutCodec`` (held-out evaluation uses the same codec).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trainer.data.records import Sample
from trainer.matching.match import MatchResult, first_predictions, match_objects
from trainer.matching.parse import ParseResult, ParseVocab, cut_before_rank
from trainer.matching.targets import TrainTarget, build_target, ground_truth_target
from trainer.modeling.prompts import PromptEncoder
from trainer.rollout.codec import RolloutCodec
from trainer.rollout.types import RolloutRequest, RolloutResult, check_prompt_alignment
from trainer.sft.mismatch import kept_engine_logprobs
from trainer.telemetry import PhaseTimers


@dataclass(frozen=True)
class MatchingSettings:
    iou_threshold: float = 0.3
    top_k: int = 5
    resolution: int = 256
    sinkhorn_epsilon: float = 0.05
    sinkhorn_iters: int = 50
    tail_desc_ce: bool = False
    prefix: str = "until_first_error"


def until_first_error(parsed: ParseResult, matched: MatchResult, num_gt: int,
                      vocab: ParseVocab) -> tuple[ParseResult, MatchResult, int]:
    """The parse and match cut before the rollout's first false positive or invalid object
    (``matching.prefix: until_first_error``), and how many valid objects that dropped."""
    fp = {parsed.objects[p].rank for p in matched.false_positives}
    first = min(fp | set(parsed.invalid_ranks), default=None)
    if first is None:
        return parsed, matched, 0
    cut = cut_before_rank(parsed, first, vocab)
    return cut, first_predictions(matched, len(cut.objects), num_gt), len(parsed.objects) - len(cut.objects)


class Stage2Pipeline(RolloutCodec):
    def __init__(self, encoder: PromptEncoder, settings: MatchingSettings = MatchingSettings()):
        super().__init__(encoder)
        self.settings = settings
        self.coord_bin_by_id = dict(self.vocab.coord_bin_by_id)
        self.eos_id = self.tokenizer.eos_token_id

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    def targets(self, samples: Sequence[Sample], requests: Sequence[RolloutRequest],
                results: Sequence[RolloutResult], timers: PhaseTimers | None = None) -> list[TrainTarget]:
        """Strict prompt check, then parse → match → target per sample (order kept). ``stats["truncated"]``: the
        engine cut the decode at ``max_new_tokens``; ``stats["broken"]``: the answer stopped being JSON (apart)."""
        timers = timers or PhaseTimers()
        check_prompt_alignment(requests, results)
        out = []
        s = self.settings
        for sample, req, res in zip(samples, requests, results):
            with timers.phase("parse"):
                parsed = self.parse(res)
            with timers.phase("match"):
                matched = match_objects([o.to_det() for o in parsed.objects], sample.objects,
                                        s.iou_threshold, s.top_k, s.resolution)
                dropped = 0
                if s.prefix == "until_first_error":
                    parsed, matched, dropped = until_first_error(parsed, matched, len(sample.objects), self.vocab)
            with timers.phase("build_target"):
                target = build_target(sample.sample_id, req.prompt_token_ids, parsed, matched, sample.objects,
                                      self.eos_id, self.encode_with_offsets, self.coord_bin_by_id,
                                      s.sinkhorn_epsilon, s.sinkhorn_iters, s.tail_desc_ce)
            target.stats["truncated"] = int(res.truncated)
            target.stats["prefix_dropped"] = dropped
            target.engine_logprobs = kept_engine_logprobs(len(req.prompt_token_ids), res.response_token_ids,
                                                          parsed.prefix_token_ids, res.logprobs)
            target.mm_inputs = dict(req.mm_inputs)
            out.append(target)
        return out

    def ground_truth_targets(self, samples: Sequence[Sample]) -> list[TrainTarget]:
        out = []
        for sample in samples:
            enc = self.encoder.encode(sample)
            t = ground_truth_target(sample.sample_id, enc.input_ids, sample.objects, self.eos_id,
                                    self.encode_with_offsets, self.coord_bin_by_id)
            t.mm_inputs = dict(enc.mm_inputs)
            out.append(t)
        return out
