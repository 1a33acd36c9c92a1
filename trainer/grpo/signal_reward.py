"""A GRPO reward that varies between the completions of one prompt even at random weights.

The twelve summary rewards (``trainer.grpo.rewards``) are gated on a parseable two-line summary, so a random-weight
model, which never writes one, gets the same total for every completion: GRPO's advantages are then all 0 and the
learner learns nothing (Qwen3-VL-4B on 2 x H100, 2026-11-26: reward -5.5, reward_std, loss and grad_norm
0 in every step). ``signal.length_distinct`` is a deterministic function of the completion and the
row's ``summary_ref`` that still separates sampled completions:

* half of it is how close the completion's length (characters, outer whitespace stripped) is to the reference
  summary's: ``min(n, m) / max(n, m)`` (a summary about as long as the reference scores 1);
* half is the fraction of distinct character trigrams (1 for text that never repeats itself, near 0 for a
  degenerate loop such as ``"aaaa…"``).

Both halves are in [0, 1]. It is not part of the summary config schema (``rlhf.reward_funcs``): the ms-swift
conformance check (``trainer.conformance.rlhf``) adds it to ``swift rlhf``'s argv, with this file in
``--external_plugins``; loaded that way (or imported) it registers ``signal.length_distinct`` in ms-swift's ``orms``.
"""

from __future__ import annotations

from typing import Any

NAME = "signal.length_distinct"
LENGTH_SHARE = 0.5  # the rest is the distinct-trigram fraction
NGRAM = 3


def length_closeness(n: int, target: int) -> float:
    """``min(n, target) / max(n, target)``: 1 when equal (both 0 included), 0 when exactly one is 0."""
    if n == target:
        return 1.0
    return min(n, target) / max(n, target)


def distinct_ratio(text: str, n: int = NGRAM) -> float:
    """Distinct character ``n``-grams over all ``n``-grams of ``text`` (0 when it has none)."""
    grams = [text[i:i + n] for i in range(len(text) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def length_distinct_score(completion: str, reference: str) -> float:
    """``signal.length_distinct`` of one completion against its row's ``summary_ref`` (module docstring)."""
    text = completion.strip()
    return (LENGTH_SHARE * length_closeness(len(text), len(reference.strip()))
            + (1.0 - LENGTH_SHARE) * distinct_ratio(text))


try:
    from swift.rewards import ORM, orms
except ImportError:  # the pure score above works without ms-swift
    ORM = orms = None

if ORM is not None:

    class LengthDistinctReward(ORM):
        """ms-swift ORM for ``signal.length_distinct``; rows must carry ``summary_ref``."""

        def __call__(self, completions: list[str], summary_ref: list[str] | None = None,
                     **kwargs: Any) -> list[float]:
            if summary_ref is None:
                raise KeyError(f"{NAME}: dataset rows need a 'summary_ref' column")
            return [float(length_distinct_score(c, r)) for c, r in zip(completions, summary_ref, strict=True)]

    orms[NAME] = LengthDistinctReward
