"""``model tiny`` at a chosen size (the GPU demo's checkpoint): the sizes reach the saved config and image processor,
a size the model cannot take is one line and exit 2, and ``make demo-gpu`` runs the recipe its config states."""

from __future__ import annotations

import json
import re
from pathlib import Path

from trainer.cli import main
from trainer.config.loader import resolve_yaml
from trainer.modeling.prepare import prepared_dir

REPO = Path(__file__).resolve().parents[2]


def test_the_sizes_reach_the_saved_checkpoint(tmp_path, capsys):
    out = tmp_path / "stock"
    assert main(["model", "tiny", "--vl", "--out", str(out), "--hidden-size", "192", "--layers", "1",
                 "--vision-hidden-size", "128", "--vision-depth", "1", "--max-pixels", "40000"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    text, vision = cfg["text_config"], cfg["vision_config"]
    assert (text["hidden_size"], text["num_hidden_layers"]) == (192, 1)
    assert (vision["hidden_size"], vision["depth"], vision["out_hidden_size"]) == (128, 1, 192)
    assert vision["num_position_embeddings"] == (200 // 16) ** 2
    processor = json.loads((out / "preprocessor_config.json").read_text())
    assert processor["size"]["longest_edge"] == 40000
    assert main(["model", "tiny", "--vl", "--out", str(tmp_path / "default")]) == 0
    default = json.loads((tmp_path / "default" / "config.json").read_text())
    assert default["vision_config"]["num_position_embeddings"] == 64 and default["text_config"]["hidden_size"] == 128


def test_a_size_the_model_cannot_take_is_one_line(tmp_path, capsys):
    assert main(["model", "tiny", "--out", str(tmp_path / "x"), "--hidden-size", "100"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "multiple of 64" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()


def test_make_demo_gpu_runs_the_recipe_its_config_states():
    makefile = (REPO / "Makefile").read_text()
    recipe = " ".join(makefile.split(f"\n{target}:", 1)[1].split("\n\n", 1)[0].replace("\\\n", " ")
                      for target in ("demo-gpu-model", "demo-gpu"))
    config = REPO / "configs" / "demo_gpu.yaml"
    header = " ".join(line.removeprefix("#").strip() for line in config.read_text().splitlines()
                      if line.startswith("#")).replace("\\ ", " ")
    tiny = re.search(r"-m trainer model tiny (.*?)\n", recipe + "\n").group(1).replace("$(DEMO_GPU)", "runs/demo-gpu")
    flags = " ".join(tiny.split())
    assert f"python -m trainer model tiny {flags}" in " ".join(header.split())
    assert resolve_yaml(config)["model"]["path"] == prepared_dir("runs/demo-gpu/stock")
    assert "--config configs/demo_gpu.yaml --seed $(SEED)" in recipe
