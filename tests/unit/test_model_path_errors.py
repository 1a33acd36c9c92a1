"""A ``model.path`` that is not a model directory: ``train``, ``eval`` and ``demo`` end with one line naming the key
and what to do, exit code 2, no traceback."""

from __future__ import annotations

import pytest

from tests.cli_runs import small_config, torch_process_state_kept
from trainer.cli import main
from trainer.config.schema import ModelConfig
from trainer.modeling.loading import NotAModelDirectory, resolve_model_dir


@pytest.mark.parametrize("command", ["train", "eval", "demo"])
@pytest.mark.parametrize("kind", ["missing", "no-config-json"])
def test_a_model_path_that_is_no_model_directory_is_one_line_and_exit_2(tmp_path, capsys, command, kind):
    model_dir = tmp_path / "models" / "qwen"
    if kind == "no-config-json":
        model_dir.mkdir(parents=True)
        (model_dir / "README.md").write_text("weights not copied yet\n")
    with torch_process_state_kept():
        assert main([command, "--config", str(small_config(tmp_path, model_dir, "bad-model.yaml"))]) == 2
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
