"""Engine failures the rollout server cannot recover from inside its process.

A dead vLLM engine core (vLLM's ``EngineDeadError``, ``vllm.v1.engine.exceptions``) or a CUDA error that poisons the
process's CUDA context (illegal memory access, device-side assert, ...) leaves the engine unusable, and a new
engine cannot be built in the same process (vLLM's sleep-mode allocator is one per process; a poisoned context stays
poisoned). The server then answers 503, ``/health/`` answers 503, and the process closes the engine and exits with
``EXIT_ENGINE_DEAD`` so its supervisor (Kubernetes ``restartPolicy``, ``docker run --restart``, a shell loop) starts
it fresh; the learner's fleet re-admits it with the current weights. A CUDA out-of-memory error is not fatal.
"""

from __future__ import annotations

from trainer.rollout.vllm_inprocess import exception_chain

EXIT_ENGINE_DEAD = 75  # EX_TEMPFAIL (sysexits.h): restart me

FATAL_CUDA_MARKERS = (
    "cuda error", "illegal memory access", "device-side assert", "unspecified launch failure", "misaligned address",
    "illegal instruction", "uncorrectable ecc error", "cudaerrorlaunchfailure",
)
OUT_OF_MEMORY_MARKERS = ("out of memory", "outofmemoryerror")
MAX_REASON_CHARS = 1000


class FatalEngineError(RuntimeError):
    """Raised by an engine whose failure leaves it unusable for the rest of the process (fatal by type)."""


class EngineDead(Exception):
    """The server's engine died: every engine call answers 503 until the process exits (``reason`` says why)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason

def fatal_engine_error(exc: BaseException) -> str | None:
    """Why ``exc`` (with its causes) means the engine is dead, else ``None`` (recoverable: answer this request with
    an error and keep serving). Fatal: a ``FatalEngineError`` or vLLM's ``EngineDeadError`` anywhere in the chain,
    else a CUDA error text other than out-of-memory."""
    chain = exception_chain(exc)
    for e in chain:
        names = {c.__name__ for c in type(e).__mro__}
        if isinstance(e, FatalEngineError) or "EngineDeadError" in names:
            return f"{type(e).__name__}: {e}"[:MAX_REASON_CHARS]
    text = "\n".join(f"{type(e).__name__}: {e}" for e in chain).lower()
    if any(m in text for m in OUT_OF_MEMORY_MARKERS):
        return None
    for e in chain:
        line = f"{type(e).__name__}: {e}"
        if any(m in line.lower() for m in FATAL_CUDA_MARKERS):
            return line[:MAX_REASON_CHARS]
    return None


def dead_detail(kind: str, reason: str) -> str:
    """The 503 ``detail`` of every engine call after the engine died."""
    return (f"the {kind} engine is dead ({reason}); it cannot be restarted inside this process, so the server is "
            f"exiting (code {EXIT_ENGINE_DEAD}) to be restarted fresh by its supervisor; retry on another server")
