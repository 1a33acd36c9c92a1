"""Stalled rollout servers for fault-injection tests, made so that the fault, never the machine's speed or load,
decides the verdict.

A stalled call does not sleep for some seconds: it blocks until it is released, by the test or by the next HTTP
request that reaches its server (with ``Stall.app``; e.g. the learner's re-admission probe, which comes only after
the learner gave up on the stalled call). So the client's ``infer_timeout_s`` always fires on it, however slow the
machine, and the stall ends exactly when the test needs the server back.

``INFER_TIMEOUT_S`` is the client timeout these tests use: a healthy scripted server answers in milliseconds (tens of
them on a loaded 2-core machine), so a normal request never comes near it; only a stall trips it."""

from __future__ import annotations

import threading
from collections.abc import Collection

INFER_TIMEOUT_S = 5.0
#: the longest a stalled call waits to be released: bounds a hang only (a test that never releases its stall)
STALL_CEILING_S = 300.0


class Stall:
    """Makes ``engine.generate`` calls hang until released: the ``calls``-th calls (1-based, counted from here on),
    or every call when ``calls`` is None. A released stall answers normally; calls after the release do not stall.

    ``stalled`` is set once a call blocks; ``finished`` once a stalled call has answered (the server's engine thread
    is free again)."""

    def __init__(self, engine, calls: Collection[int] | None = None):
        self.engine, self.calls = engine, None if calls is None else set(calls)
        self.released = threading.Event()
        self.stalled = threading.Event()
        self.finished = threading.Event()
        self.count = 0
        self._generate = engine.generate
        engine.generate = self._generate_or_stall

    def _generate_or_stall(self, requests, params):
        self.count += 1
        if self.released.is_set() or (self.calls is not None and self.count not in self.calls):
            return self._generate(requests, params)
        self.stalled.set()
        if not self.released.wait(STALL_CEILING_S):
            raise RuntimeError(f"a stalled generate call was not released within {STALL_CEILING_S:g}s (test bug)")
        try:
            return self._generate(requests, params)
        finally:
            self.finished.set()

    def release(self) -> None:
        self.released.set()

    def app(self, app):
        """``app`` (ASGI) wrapped so that an HTTP request arriving while a call is stalled releases it."""

        async def released_by_next_request(scope, receive, send):
            if scope["type"] == "http" and self.stalled.is_set():
                self.release()
            await app(scope, receive, send)

        return released_by_next_request

    def wait_finished(self, timeout_s: float = 120.0) -> None:
        """Release the stall and wait until the stalled call has answered (its engine thread is free)."""
        self.release()
        assert self.finished.wait(timeout_s), f"the released stalled call did not answer within {timeout_s:g}s"
