"""One rollout in flight ahead of the learner (``vllm.server.async_rollouts``).

The trainer knows its next optimizer step's batch (``RolloutMatchingTrainer.get_batch_samples`` reads one batch ahead
of the dataloader, which changes no sample order). After the current batch's rollouts are in hand it ``issue``\\ s the
next batch's requests (or a builder of them, run in the engine's background thread before the decode) with the
weights of its last sync (``version`` = that optimizer step) and trains while the servers decode. At the next batch's turn ``take`` returns the results if they belong to exactly these samples and decoding
parameters and ``step - version <= max_staleness_steps``; otherwise they are discarded and the caller decodes afresh
on current weights. Every decision depends on step counts only, never on timing, so runs are deterministic.

``issue(..., finish=...)`` (with a builder) also runs ``finish(requests, results)`` on a thread of the prefetcher's own
as soon as the decode returns (the trainer builds the batch's training targets there: parse, match, target), so that
CPU work overlaps the learner's step too; ``take`` hands back what it returned, or None when it raised (the caller
then builds the targets itself, and meets the same error where it belongs).

``state`` (for checkpoints) waits for the rollout in flight and returns it finished, so a resumed run trains the very
results the uninterrupted run trained (same weights version, same answers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from trainer.rollout.types import DecodingParams, RolloutRequest, RolloutResult


@dataclass
class Prefetch:
    """``requests``: what was decoded, when the prefetch built them (``issue`` with a builder); else None."""

    sample_ids: tuple[str, ...]
    params: DecodingParams
    version: int
    step: int
    future: Future | None = None
    results: list[RolloutResult] | None = None
    requests: list[RolloutRequest] | None = None
    built: bool = False
    #: what ``finish`` returned (``issue(..., finish=)``); None without one or when it raised
    finished: Any = None
    finishing: bool = False

    def wait(self) -> list[RolloutResult]:
        if self.results is None:
            assert self.future is not None
            out = self.future.result()
            self.future = None
            if self.finishing:
                out, self.finished = out
            if self.built:
                self.requests, self.results = out
            else:
                self.results = out
        return self.results


@dataclass
class RolloutPrefetcher:
    engine: Any
    max_staleness_steps: int = 1
    pending: Prefetch | None = None
    stats: dict[str, float] = field(default_factory=dict)
    _finisher: ThreadPoolExecutor | None = None

    def _count(self, key: str, n: float = 1.0) -> None:
        self.stats[key] = self.stats.get(key, 0.0) + n

    def would_exceed(self, step: int, version: int) -> bool:
        return step - version > self.max_staleness_steps

    def issue(self, requests: list[RolloutRequest] | Callable[[], list[RolloutRequest]], params: DecodingParams,
              version: int, step: int, sample_ids: Sequence[str] | None = None,
              finish: Callable[[list[RolloutRequest], list[RolloutResult]], Any] | None = None) -> bool:
        """Start decoding ``requests`` (for optimizer step ``step``) on the weights of step ``version``. Not issued
        (False) when it would exceed the staleness bound at its turn: that batch is decoded fresh then.
        ``requests`` may be a builder (with ``sample_ids``): the engine runs it in its background thread before the
        decode (``generate_async_built``), so encoding the batch overlaps the learner's step; ``finish`` (builder
        only) then runs on the prefetcher's thread once the decode is back (see the module docstring)."""
        if finish is not None and not callable(requests):
            raise ValueError("issue with finish needs a request builder")
        self.discard()
        if self.would_exceed(step, version):
            self._count("prefetch_skipped")
            return False
        if callable(requests):
            if sample_ids is None:
                raise ValueError("issue with a request builder needs the batch's sample_ids")
            future = self.engine.generate_async_built(requests, params)
            if finish is not None:
                future = self._then(future, finish)
            self.pending = Prefetch(tuple(sample_ids), params, version, step, future=future, built=True,
                                    finishing=finish is not None)
        else:
            self.pending = Prefetch(tuple(r.sample_id for r in requests), params, version, step,
                                    future=self.engine.generate_async(requests, params), requests=list(requests))
        self._count("prefetch_issued")
        return True

    def _then(self, future: Future, finish: Callable[[list[RolloutRequest], list[RolloutResult]], Any]) -> Future:
        if self._finisher is None:
            self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-finish")

        def run():
            requests, results = future.result()
            try:
                finished = finish(requests, results)
            except Exception:  # noqa: BLE001 - the caller redoes it on its own thread and meets the error there
                finished = None
            return (requests, results), finished

        return self._finisher.submit(run)

    def take(self, sample_ids: list[str], params: DecodingParams, step: int
             ) -> tuple[list[RolloutResult], int, list[RolloutRequest] | None, Any] | None:
        """The prefetched results for these samples, the weights version they were decoded with, the requests
        they were decoded from (None when not kept, e.g. after a resume) and what ``finish`` returned (None without
        one, or when it raised), or None (none pending, other samples or params, or too stale: discarded after it
        finishes, so no push tears it). A failed background decode raises here, as the synchronous ``generate``
        would have."""
        p, self.pending = self.pending, None
        if p is None:
            return None
        results = p.wait()
        if p.sample_ids != tuple(sample_ids) or p.params != params or self.would_exceed(step, p.version):
            self._count("prefetch_discarded")
            return None
        self._count("prefetch_used")
        return results, p.version, p.requests, p.finished

    def discard(self) -> None:
        """Drop the rollout in flight (waiting for it, so no request outlives its weight version)."""
        p, self.pending = self.pending, None
        if p is not None and p.future is not None:
            try:
                p.future.result()
            except Exception:  # noqa: BLE001 - a discarded decode's failure concerns nobody
                pass

    def state(self) -> dict[str, Any] | None:
        p = self.pending
        if p is None:
            return None
        return {"sample_ids": list(p.sample_ids), "params": p.params, "version": p.version, "step": p.step,
                "results": p.wait()}

    def load_state(self, state: dict[str, Any] | None) -> None:
        self.pending = None if state is None else Prefetch(tuple(state["sample_ids"]), state["params"],
                                                           state["version"], state["step"], results=state["results"])

    def pop_stats(self) -> dict[str, float]:
        out, self.stats = self.stats, {}
        return out
