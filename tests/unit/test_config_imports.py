"""``trainer.config``'s modules import one way: no module imports one that imports it back, ``TYPE_CHECKING``
imports included (``ast``; ``tests/unit/test_import_layers.py`` checks the packages, this the modules inside
``trainer/config``)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from tests.unit.test_import_layers import ROOT, find_cycle, is_module, module_name, trainer_imports

CONFIG = "trainer.config"


def config_module_graph(root: Path = ROOT) -> dict[str, dict[str, list[str]]]:
    """{module: {imported trainer.config module: [where]}} for every module of ``root/trainer/config``."""
    edges: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted((root / "trainer" / "config").glob("*.py")):
        src = module_name(path, root)
        for lineno, target, name, _ in trainer_imports(path, root):
            full = f"{target}.{name}" if name and is_module(f"{target}.{name}", root) else target
            if full.startswith(CONFIG + ".") and full != src:
                edges[src][full].append(f"{path.relative_to(root)}:{lineno}")
    return edges


def test_no_import_cycle_among_the_config_modules():
    edges = config_module_graph()
    assert "trainer.config.grpo" in edges["trainer.config.schema"], "the scan reads the schema's imports"
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle " + " -> ".join(cycle) + ": " + "; ".join(
        edges[a][b][0] for a, b in zip(cycle, cycle[1:]))


def test_a_type_checking_import_back_counts_as_a_cycle(tmp_path):
    config = tmp_path / "trainer" / "config"
    config.mkdir(parents=True)
    for init in (tmp_path / "trainer" / "__init__.py", config / "__init__.py"):
        init.write_text("")
    (config / "schema.py").write_text("from trainer.config.grpo import check\n")
    (config / "grpo.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                    "    from trainer.config.schema import TrainConfig\n")
    assert find_cycle(config_module_graph(tmp_path)) == ["trainer.config.grpo", "trainer.config.schema",
                                                         "trainer.config.grpo"]
