"""GPU index lists: parsing ``--gpus 0,1,2`` and the ``CUDA_VISIBLE_DEVICES`` value for them."""

from __future__ import annotations


def parse_gpus(text: str) -> list[int]:
    """``"0,1,2"`` → ``[0, 1, 2]``; raises ``ValueError`` naming the bad item (negatives, repeats, non-numbers)."""
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not t for t in items):
        raise ValueError(f"--gpus {text!r}: give comma-separated GPU indices, e.g. 0,1,2")
    out: list[int] = []
    for t in items:
        if not t.isdigit():
            raise ValueError(f"--gpus {text!r}: {t!r} is not a GPU index (non-negative integer)")
        g = int(t)
        if g in out:
            raise ValueError(f"--gpus {text!r}: GPU {g} listed twice")
        out.append(g)
    return out


def visible_devices(gpus: list[int]) -> str:
    return ",".join(str(g) for g in gpus)
