"""Every shell command of README.md and docs/ (fenced ```bash blocks), copied from the page, is classified here, and
every one that can run on a CPU machine runs as written.

- ``RUN``: runs here, in bash, from a scratch copy of the repository (every top-level entry a symlink; ``configs/``
  and any folder a command writes into are real, so nothing lands in the checkout), with ``.venv/bin`` first on
  PATH, one page at a time, its blocks in order (``source`` carries over to the block's later lines; a command
  the page repeats runs once). Each must exit 0, and what it writes for another tool is fed to that tool: YAML
  meant for ``kubectl apply`` is validated document by document (``kubernetes-validate``, strict, the chart's
  oldest and the newest Kubernetes schema); a config is validated by ``python -m trainer validate``.
- ``RUN_BY``: runs as written in the test named.
- ``NOT_RUN``: cannot run here, with the reason.

A command in the docs that is in none of the tables fails ``test_every_command_is_classified`` until it is."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.docs.docs_helpers import REPO, Block, all_blocks, mirror_repo

VENV_BIN = REPO / ".venv" / "bin"
#: not symlinked into a scratch copy: earlier outputs, the git metadata, and configs/ (a real folder there)
NOT_MIRRORED = frozenset({".git", "runs", "build", ".pytest_cache"})
HEREDOC = re.compile(r"<<-?\s*(['\"]?)(\w+)\1")

# --- reasons ------------------------------------------------------------------------------------------------------

GPU = "needs an NVIDIA GPU"
GPU_NODE = ("needs the GPU node: its prepared checkpoint under /data/models and its GPUs (validate checks this "
            "machine: the model path, the extras, the backend)")
CLUSTER = ("needs a Kubernetes cluster; what it creates is rendered and validated without one by "
           "tests/deploy/test_entry_points.py and `python -m trainer deploy render`")
DOCKER = ("needs a Docker daemon and root (debootstrap); .ci/docker.sh builds the images before `make test`, and "
          "tests/deploy/test_containers.py runs them")
REGISTRY = "pushes to or pulls from a container registry"
HUB = "downloads a checkpoint from the Hugging Face Hub"
HELM_INSTALL = "installs helm on the machine, from the internet or with a package manager this machine lacks"
ROOT_ON_NODE = "creates /data/runs as root on the GPU node"
USER_DATA = "reads the reader's own dataset export, which is not in the repository"
PLACEHOLDER = "names the reader's own config (my.yaml, configs/<your-3v1>.yaml), which is not in the repository"
SUITE = "is the test suite itself"


def cpu_minutes(minutes: str, what: str) -> str:
    return f"runs on a CPU but takes {minutes} minutes ({what}): longer than the suite's time allows"


DEMO_RUN = ("reads the run `python -m trainer train --config configs/demo.yaml` writes, which takes about 8 minutes "
            "on a CPU")


# --- checks of what a command wrote or printed -----------------------------------------------------------------------

@dataclass
class Ran:
    command: str
    cwd: Path
    stdout: str
    stderr: str


def kubernetes_objects(text: str) -> list[dict]:
    """The YAML documents of ``text``; each must be a Kubernetes object that validates (strict) for every version
    the chart supports."""
    from tests.deploy.deploy_helpers import assert_valid_kubernetes

    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    for doc in docs:
        assert isinstance(doc, dict) and {"apiVersion", "kind", "metadata"} <= doc.keys(), \
            f"not a Kubernetes object: {str(doc)[:200]!r}"
    assert_valid_kubernetes(docs)
    return docs


def printed_objects(ran: Ran) -> None:
    kinds = {d["kind"] for d in kubernetes_objects(ran.stdout)}
    assert {"ConfigMap", "Job"} <= kinds, kinds


def objects_in(name: str) -> Callable[[Ran], None]:
    def check(ran: Ran) -> None:
        kinds = {d["kind"] for d in kubernetes_objects((ran.cwd / name).read_text())}
        assert {"ConfigMap", "Job"} <= kinds, kinds
    return check


def resolved_config(ran: Ran) -> None:
    config = yaml.safe_load(ran.stdout)
    assert isinstance(config, dict) and "model" in config and "training" in config, ran.stdout[:500]


def records_in(name: str) -> Callable[[Ran], None]:
    def check(ran: Ran) -> None:
        lines = [json.loads(line) for line in (ran.cwd / name).read_text().splitlines() if line.strip()]
        assert lines and all("objects" in r and r["images"] for r in lines), name
    return check


def checkpoint_in(name: str, init: str | None = None) -> Callable[[Ran], None]:
    def check(ran: Ran) -> None:
        assert (ran.cwd / name / "config.json").is_file(), name
        if init:
            record = json.loads((ran.cwd / name / "prepare.json").read_text())
            assert record["tokens_added"] == 1000 and record["init"] == init, record
    return check


def validates(name: str) -> Callable[[Ran], None]:
    def check(ran: Ran) -> None:
        proc = bash(f"python -m trainer validate {name}", ran.cwd)
        assert proc.returncode == 0, f"the file written does not validate:\n{proc.stdout[-1500:]}{proc.stderr[-1500:]}"
        assert yaml.safe_load(proc.stdout)["model"]["path"] == "runs/from-stock/stock-coord-mean", proc.stdout[:500]
    return check


def pngs_in_the_copy(ran: Ran) -> None:
    from PIL import Image

    written = [Path(line) for line in ran.stdout.split()]
    assert written, "no figure written"
    for path in written:
        full = ran.cwd / path
        assert REPO not in full.resolve().parents, f"{path} was written into the checkout"
        with Image.open(full) as image:
            assert image.format == "PNG" and image.size[0] > 100, path


def rewards_printed(ran: Ran) -> None:
    import ast

    reference, headerless = [ast.literal_eval(line) for line in ran.stdout.splitlines()]
    assert reference["format"] == 1 and headerless["format"] == 0 and headerless["strict"] == -1, ran.stdout


def summary_rows(ran: Ran) -> None:
    rows = [json.loads(line) for line in (ran.cwd / "runs/summary_data/train.jsonl").read_text().splitlines()]
    assert len(rows) >= 64 and all("summary_ref" in r for r in rows), len(rows)


def prints(*words: str) -> Callable[[Ran], None]:
    def check(ran: Ran) -> None:
        assert all(w in ran.stdout for w in words), f"expected {words} in:\n{ran.stdout[-2000:]}"
    return check


def healthy(ran: Ran) -> None:
    assert json.loads(ran.stdout) == {"status": "ok"}, ran.stdout


# --- what a command needs in its scratch copy ------------------------------------------------------------------------

def writable(root: Path, rel: str) -> Path:
    """``root/rel`` as a real folder: every symlinked folder on the way becomes a real folder of symlinks, so what a
    command writes there stays in the copy."""
    path = root
    for part in Path(rel).parts:
        path = path / part
        if path.is_symlink():
            target = path.resolve()
            path.unlink()
            path.mkdir()
            if target.is_dir():
                for entry in target.iterdir():
                    (path / entry.name).symlink_to(entry)
        path.mkdir(exist_ok=True)
    return path


def coco_export(root: Path) -> None:
    """``instances_train.json`` and ``images/train/`` in the working directory: a small COCO export."""
    from tests.unit.test_data_formats import coco_fixture

    src, images = coco_fixture(root / ".fixture")
    src.rename(root / "instances_train.json")
    images.rename(writable(root, "images") / "train")


def records_file(root: Path) -> None:
    """``train.jsonl`` with its images in the working directory."""
    from tests.docs.test_own_data_cpu import write_records

    writable(root, "images")
    write_records(root, "train", 4, random.Random(0))


def saved_config(name: str, page: str) -> Callable[[Path], None]:
    """The page's YAML block whose first line is ``# <name>``, saved there."""
    def fixture(root: Path) -> None:
        (block,) = [b for b in all_blocks("yaml") if b.where.startswith(page) and b.text.startswith(f"# {name}\n")]
        (writable(root, str(Path(name).parent)) / Path(name).name).write_text(block.text)
    return fixture


def published_records(root: Path) -> None:
    """``docs/benchmarks`` copied, so redrawn figures land in the copy."""
    target = writable(root, "docs") / "benchmarks"
    target.unlink()
    shutil.copytree(REPO / "docs" / "benchmarks", target)


# --- the tables -------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Run:
    check: Callable[[Ran], None] | None = None
    fixture: Callable[[Path], None] | None = None
    serves_on: int | None = None  # runs until stopped: a server on this port, stopped when its page is done


GRPO_REWARDS = """.venv/bin/python - <<'PY'
import json
from trainer.grpo.rewards import REWARD_NAMES, reference_from_row, score
row = json.loads(open("runs/summary_data/train.jsonl").readline())
ref = reference_from_row(row["summary_ref"], row["metadata"])
for answer in (row["summary_ref"], "a summary without the header"):
    print({name.removeprefix("summary."): score(name, answer, ref) for name in REWARD_NAMES[:11]})
PY"""
MEAN_CONFIG = ("printf 'extends: %s\\nmodel: {path: runs/from-stock/stock-coord-mean}\\ntraining: {output_dir: "
               "runs/from-stock/train-mean}\\n' \"$PWD/configs/demo_from_stock.yaml\" > runs/from-stock/mean.yaml")

RUN: dict[str, Run] = {
    "make setup": Run(),
    "source .venv/bin/activate": Run(),
    "python -m trainer validate configs/demo.yaml": Run(resolved_config),
    "python -m trainer data import --from coco instances_train.json --images images/train --out data/train.jsonl":
        Run(records_in("data/train.jsonl"), coco_export),
    "python -m trainer data check data/train.jsonl": Run(prints("no errors")),
    "python -m trainer bench plot": Run(pngs_in_the_copy, published_records),
    "python -m trainer deploy render -f values-6v2.yaml > stage2.yaml": Run(objects_in("stage2.yaml")),
    "kubernetes-validate --strict stage2.yaml": Run(prints("passed")),
    "python -m trainer deploy render -f presets/3v1-2b-full.values.yaml --set storage.output.hostPath=/data/runs "
    "--set node.name=gpu-node-1 --name stage2 --namespace ml": Run(printed_objects),
    "DRY_RUN=1 make job CONFIG=configs/summary_1024.yaml": Run(printed_objects),
    "DRY_RUN=1 make job CONFIG=configs/summary-1024-job.yaml > summary-1024.yaml":
        Run(objects_in("summary-1024.yaml"), saved_config("configs/summary-1024-job.yaml", "docs/guides/deployment.md")),
    "kubernetes-validate --strict summary-1024.yaml": Run(prints("passed")),
    "python -m trainer data check train.jsonl": Run(prints("no errors"), records_file),
    "python -m trainer data check train.jsonl --max-examples 10": Run(prints("no errors")),
    "python -m trainer data check train.jsonl --fix-geometry train.fixed.jsonl": Run(records_in("train.fixed.jsonl")),
    "python -m trainer model tiny --out runs/from-stock/stock": Run(checkpoint_in("runs/from-stock/stock")),
    "python -m trainer model prepare --from runs/from-stock/stock --out runs/from-stock/stock-coord-mean --init mean":
        Run(checkpoint_in("runs/from-stock/stock-coord-mean", "mean")),
    MEAN_CONFIG: Run(validates("runs/from-stock/mean.yaml")),
    "make grpo-data": Run(summary_rows),
    GRPO_REWARDS: Run(rewards_printed),
    "python -m trainer launch server --engine swift --config configs/summary_1024.yaml --print-command":
        Run(prints("swift rollout", "--port 8080")),
    "python -m trainer launch learner --config configs/summary_1024.yaml --print-command": Run(prints("swift rlhf")),
    "python -m trainer launch server --engine scripted --config configs/summary_1024.yaml": Run(serves_on=8080),
    "curl -s http://127.0.0.1:8080/health/": Run(healthy),
    "python -m trainer serve --engine scripted --port 8002": Run(serves_on=8002),
}

RUN_BY: dict[str, str] = {
    "python -m trainer model prepare --from runs/from-stock/stock --out runs/from-stock/stock-coord":
        "tests/integration/test_from_stock_sequence.py::test_stock_prepare_stage1_stage2_eval_via_the_cli",
    "python -m trainer data check data/mine/train.jsonl":
        "tests/docs/test_own_data_cpu.py::test_the_cpu_recipe_runs_as_written",
    "python -m trainer validate configs/mine-cpu.yaml": "tests/docs/test_own_data_cpu.py::test_the_cpu_recipe_runs_as_written",
    "python -m trainer train --config configs/mine-cpu.yaml":
        "tests/docs/test_own_data_cpu.py::test_the_cpu_recipe_runs_as_written",
    "python -m trainer eval --config configs/mine-cpu.yaml --checkpoint latest":
        "tests/docs/test_own_data_cpu.py::test_the_cpu_recipe_runs_as_written",
    # the page's COCO folder /data/mycoco pointed at a fixture in the test's temporary folder
    "python -m trainer data import --from coco /data/mycoco/annotations/instances_train.json --images "
    "/data/mycoco/images/train --out /data/mycoco/train.jsonl":
        "tests/integration/test_your_own_data_doc.py::test_doc_import_check_and_validate",
    "python -m trainer data import --from coco /data/mycoco/annotations/instances_val.json --images "
    "/data/mycoco/images/val --out /data/mycoco/val.jsonl":
        "tests/integration/test_your_own_data_doc.py::test_doc_import_check_and_validate",
    "python -m trainer data check /data/mycoco/train.jsonl":
        "tests/integration/test_your_own_data_doc.py::test_doc_import_check_and_validate",
    "python -m trainer data check /data/mycoco/val.jsonl":
        "tests/integration/test_your_own_data_doc.py::test_doc_import_check_and_validate",
    "python -m trainer validate configs/mycoco.yaml":
        "tests/integration/test_your_own_data_doc.py::test_doc_import_check_and_validate",
    "python -m trainer data export --to coco /data/mycoco/val.jsonl --out runs/mycoco/eval/val_coco.json --categories "
    "/data/mycoco/annotations/instances_val.json --predictions runs/mycoco/eval/final/samples.jsonl --evaluate":
        "tests/integration/test_your_own_data_doc.py::test_doc_train_eval_export_on_the_tiny_vl_model",
}

GPU_LAYOUTS = [
    "python -m trainer bench run benchmarks/layouts.yaml --only " + only for only in (
        "colocate-1,colocate-2", "colocate-1-shipped,colocate-2-shipped", "colocate-1-shipped-zero2",
        "colocate-1-shipped,colocate-4-shipped", "colocate-4-preset", "3v1-preset",
        "colocate-1-pixels-auto-compile-recload,colocate-2-r128-pixels-auto-compile-recload,colocate-1-auto-compile,"
        "1v1-async-auto-compile", "colocate-1,colocate-1-auto-compile",
        "colocate-4-r256-pixels,colocate-4-r256-pixels-auto-compile",
        "colocate-1,3v1-async,colocate-1-auto-compile,3v1-async-auto-compile,2v2-async-auto-compile",
        "colocate-1,colocate-4-zero2", "colocate-1,colocate-2,1v1-async,1v1-sync,colocate-tp2",
        "colocate-1,colocate-4,colocate-4-r256,colocate-tp4,2v2-async", "colocate-4-r256-pixels-auto-compile",
        "3v1-async-auto-compile", "colocate-1-shipped,colocate-8-shipped,6v2-shipped", "colocate-8,6v2-async,7v1-async")
]

NOT_RUN: dict[str, str] = {
    "make demo": cpu_minutes("about 8", "the CPU demo's 1,000 warm-up steps, 40 stage-2 steps and two evaluations"),
    "make test": SUITE,
    "python -m trainer train --config configs/demo.yaml": cpu_minutes("about 8", "the CPU demo's training"),
    "python -m trainer eval --config configs/demo.yaml --checkpoint latest": DEMO_RUN,
    "python -m trainer eval --config configs/demo.yaml": cpu_minutes(
        "about 6", "greedy decoding of 200 held-out scenes by the random tiny model, up to 160 tokens each"),
    "python -m trainer demo --seed 1": cpu_minutes("about 8", "the CPU demo at another seed"),
    "make bench": cpu_minutes("several", "benchmarks/cpu.yaml: three layouts, each starting vLLM on the CPU"),
    "python -m trainer bench run benchmarks/learning-cpu.yaml": cpu_minutes("about 21", "the CPU demo at 3 seeds"),
    "python -m trainer bench run benchmarks/learning.yaml --only colocate,control,hf": GPU,
    "python -m trainer bench run benchmarks/scale.yaml --only 4b-kvcache-levers": GPU,
    "python -m trainer bench run benchmarks/scale.yaml --only 8b-lora64-levers": GPU,
    **{command: GPU for command in GPU_LAYOUTS},
    "python -m trainer validate my.yaml": PLACEHOLDER,
    "python -m trainer train --config my.yaml": PLACEHOLDER,
    "torchrun --nproc_per_node 4 -m trainer train --config my.yaml": PLACEHOLDER,
    "python -m trainer launch learner --config my.yaml --gpus 0,1,2,3": PLACEHOLDER,
    "for i in 0 1 2; do\nCUDA_VISIBLE_DEVICES=$i python -m trainer serve --engine vllm --model /models/policy --port "
    "$((8000+i)) --max-model-len 4096 --gpu-memory-utilization 0.9 --enable-lora --max-lora-rank 64 &\ndone": GPU,
    "CUDA_VISIBLE_DEVICES=3 python -m trainer train --config configs/<your-3v1>.yaml": GPU,
    "sudo mkdir -p /data/runs && sudo chown 1000:1000 /data/runs": ROOT_ON_NODE,
    "helm install stage2 charts/rollout-matching -f values-6v2.yaml": CLUSTER,
    "helm install stage2 charts/rollout-matching -f values-colocate.yaml": CLUSTER,
    "helm install stage2 charts/rollout-matching -f values-3v1.yaml": CLUSTER,
    "curl -fsSL https://raw.githubusercontent.com/helm/helm/main/scripts/get-helm-4 | bash": HELM_INSTALL,
    "brew install helm": HELM_INSTALL,
    "sudo snap install helm --classic": HELM_INSTALL,
    "helm install stage2 charts/rollout-matching -f presets/colocate-8-2b-full.values.yaml --set node.name=gpu-node-1 "
    "--set storage.output.hostPath=/data/runs": CLUSTER,
    "helm install stage2 charts/rollout-matching -f presets/6v2-2b-full.values.yaml --set node.name=gpu-node-1 "
    "--set storage.output.claimName=stage2-runs": CLUSTER,
    "helm install stage2 charts/rollout-matching -f presets/6v2-2b-full.values.yaml --set node.name=gpu-node-1 "
    "--set storage.output.hostPath=/data/runs": CLUSTER,
    "helm install stage2 charts/rollout-matching -f presets/3v1-2b-full.values.yaml --set node.name=gpu-node-1 "
    "--set storage.output.hostPath=/data/runs --set learner.config.tuner.train_type=dora "
    "--set learner.config.tuner.lora_rank=32": CLUSTER,
    "helm install stage2 charts/rollout-matching -f values-colocate.yaml -f mine.values.yaml": CLUSTER,
    "helm install stage2 charts/rollout-matching -f values-6v2.yaml -f mine.values.yaml": CLUSTER,
    "kubectl logs -f job/stage2-rollout-matching-learner": CLUSTER,
    "helm uninstall stage2": CLUSTER,
    "helm test stage2": CLUSTER,
    "make job CONFIG=configs/summary_1024.yaml": CLUSTER,
    "make job CONFIG=configs/summary-1024-job.yaml": CLUSTER,
    "kubectl delete jobs,configmaps -l rollout-matching/run=summary-1024-job": CLUSTER,
    "docker run -d --name learner --restart on-failure:3 --gpus all --network host --ipc host --shm-size 64g "
    "-v /data/models:/models:ro -v /data/datasets:/data:ro -v /data/runs:/output "
    "-v \"$PWD/presets/colocate-8-2b-full.yaml:/etc/rollout-matching/train.yaml:ro\" rollout-matching/learner:0.1.0 "
    "launch learner --config /etc/rollout-matching/train.yaml --gpus 0,1,2,3,4,5,6,7 --resume auto": GPU,
    "python -m trainer launch learner --config presets/colocate-8-2b-full.yaml --gpus 0,1,2,3,4,5,6,7 --resume auto":
        GPU_NODE,
    "make base-image": DOCKER,
    "make images": DOCKER,
    "make images IMAGE_BASE=official": REGISTRY + " (the official vLLM base image)",
    "make images TORCH_WHEEL=/path/torch-2.13.0+cpu-…whl IMAGE_TAG=dev": DOCKER,
    "make images IMAGE_BASE=official IMAGE_REPO=registry.example.com/ml": REGISTRY + " (the official vLLM base image)",
    "docker push registry.example.com/ml/learner:0.1.0": REGISTRY,
    "docker push registry.example.com/ml/rollout-server:0.1.0": REGISTRY,
    "docker run -d --name rollout-0 --restart on-failure --gpus '\"device=0\"' --network host --ipc host "
    "-v /data/models:/models:ro -v /data/datasets:/data:ro rollout-matching/rollout-server:0.1.0 launch server "
    "--engine vllm --host 127.0.0.1 --port 8000 --gpus 0 --model /models/policy --max-model-len 8192": GPU,
    "docker run --rm --gpus 4 --ipc host --shm-size 64g -v /data/models:/models:ro -v /data/datasets:/data:ro "
    "-v /data/runs:/output -v \"$PWD/presets/colocate-4-2b-full.yaml:/etc/rollout-matching/train.yaml:ro\" "
    "rollout-matching/learner:0.1.0 launch learner --config /etc/rollout-matching/train.yaml --nproc-per-node 4 "
    "--gpus 0,1,2,3 --resume auto": GPU,
    "python -m trainer supervise server --learner-control http://127.0.0.1:20301 -- launch server --engine vllm "
    "--host 127.0.0.1 --port 8000 --gpus 0 --model /models/policy &": GPU,
    "python -m trainer supervise learner --control-port 20301 --final-on-failure --expect-watchers 1 -- launch learner "
    "--config train.yaml --gpus 1 --wait-for-servers http://127.0.0.1:8000": GPU,
    "python -m trainer train --config configs/mycoco.yaml": GPU_NODE,
    "python -m trainer eval --config configs/mycoco.yaml --checkpoint latest": GPU_NODE,
    "python -m trainer data import --from lvis lvis_v1_val.json --images /data/coco --out /data/lvis/val.jsonl":
        USER_DATA + " (LVIS v1 annotations and the COCO images)",
    "python -m trainer data import --from odvg train.odvg.jsonl --images /data/o365/images --out /data/o365/train.jsonl "
    "--label-map /data/o365/label_map.json": USER_DATA + " (an ODVG export of Objects365)",
    "hf download Qwen/Qwen3-VL-4B-Instruct --local-dir /data/models/Qwen3-VL-4B-Instruct": HUB,
    "python -m trainer model prepare --from /data/models/Qwen3-VL-4B-Instruct --out "
    "/data/models/Qwen3-VL-4B-Instruct-coord": "prepares the checkpoint `hf download` fetches from the Hugging Face Hub",
    "python -m trainer train --config stage1_2b.yaml": GPU + " (a Qwen3-VL-2B at 1024 px, bf16)",
    "python -m trainer eval --config my.yaml --checkpoint runs/my-run/stage1/checkpoint-500": PLACEHOLDER,
    "python -m trainer train --config configs/demo_from_stock.yaml": cpu_minutes("5 to 11", "500 warm-up steps, 40 "
                                                                                 "stage-2 steps"),
    "python -m trainer eval --config configs/demo_from_stock.yaml --checkpoint latest":
        "reads the run of `train --config configs/demo_from_stock.yaml`, 5 to 11 minutes on a CPU",
    "python -m trainer demo --config configs/demo_from_stock.yaml": cpu_minutes("5 to 11", "the from-stock demo"),
    "python -m trainer demo --config runs/from-stock/mean.yaml": cpu_minutes("5 to 11", "the from-stock demo, mean init"),
    "python -m trainer validate configs/mycoco-colocate.yaml": GPU_NODE,
    "python -m trainer launch learner --config configs/mycoco-colocate.yaml --gpus 0,1,2,3,4,5,6,7 --resume auto": GPU,
    "python -m trainer launch learner --config configs/mycoco-colocate.yaml --gpus 0,1,2,3,4,5,6,7": GPU,
    "python -m trainer eval --config configs/mycoco-colocate.yaml --checkpoint latest": GPU_NODE,
    "python -m trainer data import --from coco /data/datasets/mycoco/annotations/instances_train.json --images "
    "/data/datasets/mycoco/images/train --out /data/datasets/mycoco/train.jsonl": USER_DATA,
    "python -m trainer data import --from coco /data/datasets/mycoco/annotations/instances_val.json --images "
    "/data/datasets/mycoco/images/val --out /data/datasets/mycoco/val.jsonl": USER_DATA,
    "python -m trainer data check /data/datasets/mycoco/train.jsonl": USER_DATA,
    "for i in 0 1 2 3 4 5; do\npython -m trainer launch server --engine vllm --gpus $i --port $((8000 + i)) --model "
    "/data/models/Qwen3-VL-2B-Instruct-coord --max-model-len 8192 --gpu-memory-utilization 0.6 --cpu-affinity node "
    "&\ndone": GPU,
    "python -m trainer validate configs/mycoco-6v2.yaml": GPU_NODE,
    "python -m trainer launch learner --config configs/mycoco-6v2.yaml --gpus 6,7 --wait-for-servers config": GPU,
    "make demo-gpu SEED=0": GPU,
    "python -m trainer launch server --engine swift --config configs/summary_1024.yaml": GPU,
    "python -m trainer launch learner --config configs/summary_1024.yaml --wait-for-servers config "
    "--health-timeout-s 900": GPU,
    "python -m trainer eval --config my.yaml --checkpoint runs/x/stage2/checkpoint-200 --split heldout.jsonl --out "
    "runs/x/eval-200": PLACEHOLDER,
    "python -m trainer serve --engine vllm --model /models/policy --port 8000 --max-model-len 4096 "
    "--gpu-memory-utilization 0.9 --enable-lora --max-lora-rank 64": GPU,
    "python -m trainer serve --engine hf --model /models/policy --port 8001":
        "needs a checkpoint at /models/policy, the path the chart mounts on the GPU node",
}


# --- reading the pages ------------------------------------------------------------------------------------------------

def strip_comment(line: str) -> str:
    """``line`` without its shell comment: a ``#`` outside quotes, at the start or after whitespace."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def commands(text: str) -> list[str]:
    """The commands of a bash block: each logical line (continuations joined, whitespace collapsed, comments
    dropped), a here-document with its body, a ``for``/``while`` loop through its ``done``."""
    lines = text.replace("\\\n", " ").splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        code = " ".join(strip_comment(lines[i]).split())
        i += 1
        if not code:
            continue
        if heredoc := HEREDOC.search(code):
            body = []
            while i < len(lines) and lines[i].strip() != heredoc.group(2):
                body.append(lines[i])
                i += 1
            i += 1
            out.append("\n".join([code, *body, heredoc.group(2)]))
        elif re.match(r"(for|while|until)\b", code):
            loop = [code]
            while i < len(lines) and strip_comment(lines[i]).strip() != "done":
                if part := " ".join(strip_comment(lines[i]).split()):
                    loop.append(part)
                i += 1
            i += 1
            out.append("\n".join([*loop, "done"]))
        else:
            out.append(code)
    return out


BLOCKS = all_blocks("bash")
PAGES = sorted({b.path.relative_to(REPO).as_posix() for b in BLOCKS})


def documented() -> dict[str, list[str]]:
    """Every command of the docs → where it is (``page:line`` of its block)."""
    out: dict[str, list[str]] = {}
    for block in BLOCKS:
        for command in commands(block.text):
            out.setdefault(command, []).append(block.where)
    return out


# --- running ---------------------------------------------------------------------------------------------------------

def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "VIRTUAL_ENV")}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def bash(command: str, cwd: Path) -> subprocess.CompletedProcess:
    # the limit only ends a hang: the slowest command here (model tiny) takes about 16 s
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=environment(), capture_output=True, text=True,
                          timeout=900)


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def start_server(command: str, cwd: Path, port: int, log: Path) -> subprocess.Popen:
    assert not port_open(port), f"port {port} is taken before `{command}` starts: stop what holds it"
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=environment(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300  # ends a hang only; the stub server listens within seconds
    while not port_open(port):
        if proc.poll() is not None:
            pytest.fail(f"`{command}` exited {proc.returncode} before listening on {port}:\n{log.read_text()[-3000:]}")
        assert time.monotonic() < deadline, f"`{command}` never listened on {port}:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)
    return proc


def stop_server(proc: subprocess.Popen, command: str, log: Path) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"`{command}` did not stop on SIGTERM:\n{log.read_text()[-2000:]}")


def page_blocks(page: str) -> list[Block]:
    return [b for b in BLOCKS if b.path.relative_to(REPO).as_posix() == page]


RUNNABLE_PAGES = [p for p in PAGES if any(c in RUN for b in page_blocks(p) for c in commands(b.text))]


@pytest.fixture(scope="module")
def venv_stages_current():
    """The venv's set-up stages brought up to date from the checkout itself, so that a ``make`` command run in a
    scratch copy finds them current and installs nothing from there (an editable install must point here)."""
    proc = subprocess.run(["make", "--no-print-directory", "setup", ".venv/.deploy"], cwd=REPO, env=environment(),
                          capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, f"make setup .venv/.deploy failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_the_page_commands_run_as_written(page, tmp_path, venv_stages_current):
    root = mirror_repo(tmp_path, NOT_MIRRORED)
    ran: set[str] = set()
    servers: list[tuple[subprocess.Popen, str, Path]] = []
    timings = []
    try:
        for block in page_blocks(page):
            prelude: list[str] = []
            for command in commands(block.text):
                run = RUN.get(command)
                if run is None or command in ran:
                    continue
                ran.add(command)
                if run.fixture:
                    run.fixture(root)
                script = "\n".join([*prelude, command])
                start = time.monotonic()
                if run.serves_on is not None:
                    log = tmp_path / f"server-{run.serves_on}.log"
                    servers.append((start_server(script, root, run.serves_on, log), command, log))
                else:
                    proc = bash(script, root)
                    assert proc.returncode == 0, (f"{block.where}: `{command}` exited {proc.returncode}\n"
                                                  f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
                    if run.check:
                        run.check(Ran(command, root, proc.stdout, proc.stderr))
                timings.append(f"{time.monotonic() - start:5.1f} s  {command.splitlines()[0][:100]}")
                if command.startswith(("source ", "export ", "cd ")):
                    prelude.append(command)
        for proc, command, log in servers:
            assert proc.poll() is None, f"`{command}` stopped on its own:\n{log.read_text()[-2000:]}"
            if not any(RUN[c].check is healthy for c in ran):
                import httpx

                port = RUN[command].serves_on
                assert httpx.get(f"http://127.0.0.1:{port}/health/", timeout=10).json() == {"status": "ok"}, command
    finally:
        for proc, command, log in servers:
            stop_server(proc, command, log)
    print(f"{page}:", *timings, sep="\n  ")


# --- the tables against the docs ------------------------------------------------------------------------------------

def test_every_command_is_classified():
    tables = {"RUN": RUN, "RUN_BY": RUN_BY, "NOT_RUN": NOT_RUN}
    unknown = {c: where for c, where in documented().items() if not any(c in t for t in tables.values())}
    assert not unknown, ("commands in the docs that this module does not know; add each to RUN (it runs here), "
                         "RUN_BY (a named test runs it as written) or NOT_RUN (with the reason):\n"
                         + "\n".join(f"  {where}: {c!r}" for c, where in unknown.items()))
    twice = [c for c in documented() if sum(c in t for t in tables.values()) > 1]
    assert not twice, f"classified twice: {twice}"


def test_every_classified_command_is_in_the_docs():
    stale = [c for c in (*RUN, *RUN_BY, *NOT_RUN) if c not in documented()]
    assert not stale, f"no longer in the docs (remove them from the tables): {stale}"


def test_every_not_run_command_has_a_reason_and_the_list_is_printed(capsys):
    where = documented()
    assert all(isinstance(r, str) and len(r) > 10 for r in NOT_RUN.values()), "every command not run says why"
    lines = [f"  {where[c][0]}: {c.splitlines()[0][:110]}\n      {reason}" for c, reason in NOT_RUN.items()]
    lines += [f"  {where[c][0]}: {c.splitlines()[0][:110]}\n      run as written by {test}" for c, test in RUN_BY.items()]
    with capsys.disabled():
        print(f"\ndocs commands not run by tests/docs/test_docs_commands.py ({len(NOT_RUN)} cannot run here, "
              f"{len(RUN_BY)} run elsewhere; {len(RUN)} run here):", *lines, sep="\n")


@pytest.mark.parametrize("command", RUN_BY)
def test_the_named_test_exists_and_reads_the_page(command):
    path, name = RUN_BY[command].split("::")
    source = (REPO / path).read_text()
    assert re.search(rf"^def {name}\(", source, re.M), f"{path} has no test {name}"
    page = next(w for w in documented()[command]).split(":")[0]
    assert Path(page).name in source or Path(page).stem in source, f"{path} does not read {page}"


def test_commands_reads_loops_heredocs_and_comments():
    text = ("make demo   # a comment\nfor i in 0 1; do\n  echo $i &   # each\ndone\npython - <<'PY'\nprint('#1')\nPY\n"
            "helm install a b \\\n  --set x=1\necho 'a # b'\n")
    assert commands(text) == ["make demo", "for i in 0 1; do\necho $i &\ndone", "python - <<'PY'\nprint('#1')\nPY",
                              "helm install a b --set x=1", "echo 'a # b'"]


def test_the_kubernetes_check_refuses_what_is_no_object():
    """The check the renders pass can fail: a recipe line echoed before the YAML, or an unknown field."""
    with pytest.raises(AssertionError, match="not a Kubernetes object"):
        kubernetes_objects(".venv/bin/python -m trainer render-job --config x.yaml\n---\n"
                           "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    with pytest.raises(AssertionError, match="invalid"):
        kubernetes_objects("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\ndata: {a: b}\nextra: 1\n")
