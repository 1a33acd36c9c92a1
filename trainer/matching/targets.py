"""One teacher-forced target per sample: ``Y_train = rollout prefix + FN append + EOS`` with its masks.

Label rules (``docs/concepts/decisions.md``): prompt tokens — no loss. Rollout prefix — non-coord tokens no loss;
coord tokens of matched objects get coord loss towards the matched GT. Appended tail — it starts at the junction
(the parse's ``junction_text``: the decision token's text up to the cut) and is tokenised as one string, so the
target holds the tokens the model emits there (``},`` / ``}}``, never a lone ``}`` then ``,``); non-coord tokens get
full-vocabulary CE (the decision token included) except the tokens of ``desc`` string values; coord tokens get
coord loss towards their GT. The final EOS gets CE. Positions index the full sequence (prompt + response).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainer.data.objects import DetObject
from trainer.data.output_format import OBJECT_KEY_PREFIX, serialize_append, serialize_object
from trainer.matching.match import MatchResult
from trainer.matching.parse import ParseResult
from trainer.matching.poly_align import coord_targets

IGNORE_INDEX = -100


class TargetError(RuntimeError):
    """A target violates an invariant (a bug or a misaligned tokenizer), never bad model output."""


@dataclass
class TrainTarget:
    sample_id: str
    input_ids: list[int]
    labels: list[int]
    coord_positions: list[int]
    coord_targets: list[float]
    prompt_len: int
    prefix_len: int
    tail_len: int
    stats: dict[str, int] = field(default_factory=dict)
    mm_inputs: dict[str, Any] = field(default_factory=dict)
    #: ``(position, log-probability)`` the engine sampled each kept rollout-prefix token with
    #: (``trainer.sft.mismatch.kept_engine_logprobs``); empty when the engine returned none
    engine_logprobs: list[tuple[int, float]] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class TailTokens:
    ids: list[int]
    ce_mask: list[bool]
    coord_bins: list[int | None]


def encode_tail(fn_objects: Sequence[DetObject], start_index: int, prefix_last_char: str,
                encode_with_offsets: Callable[[str], tuple[list[int], list[tuple[int, int]]]],
                coord_bin_by_id: dict[int, int], desc_ce: bool = False, junction: str = "") -> TailTokens:
    """Tokenise ``junction`` + the FN append (incl. the closing ``}``) as one string and mark CE / desc / coord
    tokens. ``prefix_last_char`` is the last character of prefix + junction.

    ``desc_ce`` false (stage 2): tokens overlapping a ``desc`` string value get no CE.
    """
    text = junction + serialize_append(fn_objects, start_index, prefix_last_char)
    desc_spans: list[tuple[int, int]] = []
    cursor = text.find(OBJECT_KEY_PREFIX)
    for obj in fn_objects:
        obj_text = serialize_object(obj)
        start = text.index(obj_text, cursor) + len('{"desc": ')
        desc_spans.append((start + 1, start + len(json.dumps(obj.desc, ensure_ascii=False)) - 1))
        cursor = start + len(obj_text)
    ids, offsets = encode_with_offsets(text)
    in_desc = overlaps_any(offsets, desc_spans) if not desc_ce else [False] * len(ids)
    bins: list[int | None] = [coord_bin_by_id.get(tid) for tid in ids]
    ce_mask = [coord is None and not d for coord, d in zip(bins, in_desc)]
    return TailTokens(ids, ce_mask, bins)


def overlaps_any(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[bool]:
    """Per ``(a, b)`` character range: whether it overlaps some ``(s, e)`` of ``spans`` (``a < e and b > s``).
    ``spans`` must be in text order and not overlap each other (their starts and ends both non-decreasing); one
    binary search per range instead of a scan of every span."""
    ends = [e for _, e in spans]
    out = []
    for a, b in offsets:
        i = bisect.bisect_right(ends, a)  # the first span ending after a: the one with the smallest start among them
        out.append(i < len(spans) and spans[i][0] < b)
    return out


def build_target(sample_id: str, prompt_ids: Sequence[int], parse: ParseResult, match: MatchResult,
                 gts: Sequence[DetObject], eos_id: int,
                 encode_with_offsets: Callable[[str], tuple[list[int], list[tuple[int, int]]]],
                 coord_bin_by_id: dict[int, int], sinkhorn_epsilon: float = 0.05,
                 sinkhorn_iters: int = 50, desc_ce: bool = False) -> TrainTarget:
    """Assemble ids, CE labels and coord supervision; raises ``TargetError`` on a broken invariant. ``desc_ce``:
    the appended tail's ``desc`` value tokens get CE too (``loss.tail_desc_ce``)."""
    prompt = list(prompt_ids)
    prefix = list(parse.prefix_token_ids)
    p_len = len(prompt)
    fn = [gts[g] for g in match.false_negatives]
    start_index = parse.max_object_index + 1
    tail = encode_tail(fn, start_index, parse.prefix_last_char, encode_with_offsets, coord_bin_by_id, desc_ce,
                       junction=parse.junction_text)
    input_ids = prompt + prefix + tail.ids + [eos_id]
    labels = [IGNORE_INDEX] * (p_len + len(prefix))
    labels += [tid if ce else IGNORE_INDEX for tid, ce in zip(tail.ids, tail.ce_mask)]
    labels.append(eos_id)
    positions: list[int] = []
    targets: list[float] = []
    excluded = 0
    for p_idx, g_idx, _iou in match.pairs:
        pred = parse.objects[p_idx]
        if any(pos >= len(prefix) or prefix[pos] not in coord_bin_by_id for pos in pred.coord_positions):
            excluded += 1
            continue
        tgt = coord_targets(pred.to_det(), gts[g_idx], sinkhorn_epsilon, sinkhorn_iters)
        positions.extend(p_len + pos for pos in pred.coord_positions)
        targets.extend(tgt)
    base = p_len + len(prefix)
    fn_coords = [float(c) for o in fn for c in o.coords]
    tail_coord_pos = [base + i for i, b in enumerate(tail.coord_bins) if b is not None]
    if len(tail_coord_pos) != len(fn_coords):
        raise TargetError(f"sample {sample_id!r}: tail has {len(tail_coord_pos)} coord tokens for {len(fn_coords)} FN coords")
    positions.extend(tail_coord_pos)
    targets.extend(fn_coords)
    if any(p < p_len or p >= len(input_ids) for p in positions):
        raise TargetError(f"sample {sample_id!r}: a supervised coord position lies outside the assistant span")
    if any(lab != IGNORE_INDEX for lab in labels[:p_len]):
        raise TargetError(f"sample {sample_id!r}: prompt tokens carry labels")
    stats = {
        "matched": match.num_matched - excluded,
        "excluded_alignment": excluded,
        "fn_appended": len(fn),
        "fp": len(match.false_positives),
        "gated": match.gated,
        "gt": len(gts),
        "valid_pred": len(parse.objects),
        "invalid_pred": parse.num_invalid,
        "truncated": int(parse.truncated and not parse.broken),
        "broken": int(parse.broken),
        "supervised_coords": len(positions),
        "ce_tokens": sum(1 for lab in labels if lab != IGNORE_INDEX),
        "junction_fused": int(parse.junction_fused),
    }
    return TrainTarget(sample_id, input_ids, labels, positions, targets, p_len, len(prefix), len(tail.ids) + 1, stats)


def ground_truth_target(sample_id: str, prompt_ids: Sequence[int], gts: Sequence[DetObject], eos_id: int,
                        encode_with_offsets: Callable[[str], tuple[list[int], list[tuple[int, int]]]],
                        coord_bin_by_id: dict[int, int]) -> TrainTarget:
    """Stage-1 (teacher-forced on GT) target: the same rules with an empty rollout (no prefix, junction ``{``, all
    GT FN): the whole answer tokenised as one string, as stage 2 tokenises a target without a cut.

    Plain SFT: the opening ``{`` and the ``desc`` values get CE too, so a fresh model learns the whole answer.
    """
    tail = encode_tail(list(gts), 1, "{", encode_with_offsets, coord_bin_by_id, desc_ce=True, junction="{")
    prompt = list(prompt_ids)
    input_ids = prompt + tail.ids + [eos_id]
    labels = [IGNORE_INDEX] * len(prompt)
    labels += [tid if ce else IGNORE_INDEX for tid, ce in zip(tail.ids, tail.ce_mask)] + [eos_id]
    base = len(prompt)
    positions = [base + i for i, b in enumerate(tail.coord_bins) if b is not None]
    targets = [float(c) for o in gts for c in o.coords]
    if len(positions) != len(targets):
        raise TargetError(f"sample {sample_id!r}: GT serialisation has {len(positions)} coord tokens for {len(targets)} coords")
    return TrainTarget(sample_id, input_ids, labels, positions, targets, len(prompt), 0, len(tail.ids) + 1,
                       {"gt": len(gts), "supervised_coords": len(positions)})
