"""A ``model.path`` that is not a model directory: ``train``, ``eval`` and ``demo`` end with one line naming the key
and what to do, exit code 2, no traceback."""

from __future__ import annotations

import pytest
import torch
import yaml

from trainer.cli import main
from trainer.config.schema import ModelConfig
from trainer.modeling.loading import NotAModelDirectory, resolve_model_dir


def _config(tmp_path, model_path):
    path = tmp_path / "bad-model.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"path": str(model_path)},
        "data": {"synthetic": {"num_samples": 4, "eval_num_samples": 2, "image_size": 64}},
        "training": {"output_dir": str(tmp_path / "run"), "max_steps": 1, "report_to": ["jsonl"]},
        "custom": {"extra": {"rollout_matching": {"rollout_backend": "hf"}}}}))
    return path


@pytest.mark.parametrize("command", ["train", "eval", "demo"])
@pytest.mark.parametrize("kind", ["missing", "no-config-json"])
def test_a_model_path_that_is_no_model_directory_is_one_line_and_exit_2(tmp_path, capsys, command, kind):
    model_dir = tmp_path / "models" / "qwen"
    if kind == "no-config-json":
        model_dir.mkdir(parents=True)
        (model_dir / "README.md").write_text("weights not copied yet\n")
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        assert main([command, "--config", str(_config(tmp_path, model_dir))]) == 2
    finally:  # demo pins both for its process
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    (line,) = errors
    assert line.startswith(f"error: model.path {model_dir} ")
    assert ("does not exist" if kind == "missing" else "no config.json") in line
    assert "python -m trainer model prepare" in line and "model.tiny" in line
    assert not (tmp_path / "run" / "stage2").exists(), "nothing trained"


def test_resolve_model_dir_raises_a_file_not_found_error_too(tmp_path):
    """Callers that catch ``FileNotFoundError`` (the loader's contract before) still catch it."""
    with pytest.raises(FileNotFoundError, match=r"model\.path .* does not exist"):
        resolve_model_dir(ModelConfig(path=str(tmp_path / "nope")), tmp_path)
    with pytest.raises(NotAModelDirectory):
        resolve_model_dir(ModelConfig(path=str(tmp_path)), tmp_path)
