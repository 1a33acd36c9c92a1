"""Rollout buffer: windows repeat m times, M-steps replay without rollouts, no sample is skipped."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainer.buffering.rollout_buffer import RolloutBuffer, StaleBufferError, repeat_windows, repeated_length


@given(n=st.integers(0, 40), window=st.integers(1, 5), m=st.integers(1, 4))
def test_repeater_keeps_every_sample_and_repeats_full_windows(n, window, m):
    batches = [(f"a{i}", f"b{i}") for i in range(n)]
    out = list(repeat_windows(batches, window, m))
    assert len(out) == repeated_length(n, window, m)
    assert set(out) == set(batches)
    counts = Counter(out)
    full = (n // window) * window
    assert all(counts[b] == m for b in batches[:full]) and all(counts[b] == 1 for b in batches[full:])


def test_epoch_multiset_of_trained_ids_equals_the_dataset():
    dataset = [f"s{i}" for i in range(23)]
    micro = [dataset[i:i + 2] for i in range(0, len(dataset), 2)]
    buf = RolloutBuffer(window=3, m_steps=4)
    rollouts: list[str] = []
    trained_fresh: list[str] = []
    for batch in repeat_windows(micro, 3, 4):
        _, fresh, staleness = buf.prepare(batch, lambda b=batch: rollouts.extend(b) or {"ids": list(b)})
        assert staleness <= 3
        if fresh:
            trained_fresh.extend(batch)
    assert Counter(rollouts) == Counter(dataset), "each sample is rolled out exactly once per epoch"
    assert Counter(trained_fresh) == Counter(dataset)
    assert buf.m_replays == (len(micro) // 3) * 3 * 3


def test_m_steps_replay_copies_and_check_fingerprints():
    buf = RolloutBuffer(window=1, m_steps=2)
    first, fresh, _ = buf.prepare(["x"], lambda: {"v": [1]})
    first["v"].append(99)
    again, fresh2, stale = buf.prepare(["x"], lambda: pytest.fail("M-step must not roll out"))
    assert fresh and not fresh2 and stale == 1 and again == {"v": [1]}, "the cache is isolated from mutation"
    buf.prepare(["y"], lambda: {"v": [2]})
    with pytest.raises(StaleBufferError, match="repeat each accumulation window"):
        buf.prepare(["z"], lambda: {})
