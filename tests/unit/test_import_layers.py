"""The ``trainer/`` package import graph reads as layers, not a web.

Every module's imports of ``trainer.*`` — top level and inside functions alike — are read with ``ast`` and folded
into a package-level graph (``trainer.config``, ``trainer.sync``, …; a top-level module such as
``trainer/telemetry.py`` is its own node). The intended layering, lowest first; a package may import only from
strictly lower layers (never sideways, never up):

0. foundation — ``trainer`` (the root package), ``trainer.extras``, ``trainer.telemetry``, ``trainer.profiling``: no
   trainer imports
1. ``trainer.config`` — loader, errors and the typed schema of *every* section (deploy, grpo, vllm, deepspeed
   presets included); the only place that knows config key paths. ``trainer.loggers`` — the W&B / MLflow
   loggers of ``training.report_to``, mirrors of ``metrics.jsonl``
2. ``trainer.data``, ``trainer.sync``, ``trainer.buffering``, ``trainer.memory`` — records/synthetic data, weight-update transports,
   the rollout buffer and offload
3. ``trainer.matching``, ``trainer.losses`` — parse / match / targets, loss terms (pure functions)
4. ``trainer.modeling``, ``trainer.packing`` — model loading and prompts, padded and packed model batches
5. ``trainer.rollout`` — rollout engines (HF, vLLM colocate, server client) and the request/response codec
6. ``trainer.server``, ``trainer.evaluation``, ``trainer.grpo`` — rollout server, held-out evaluation, summary GRPO
7. ``trainer.sft`` — the stage-2 trainer and its run
8. ``trainer.launch``, ``trainer.deploy`` — launchers and job rendering
9. entry points — ``trainer.cli``, ``trainer.demo``, ``trainer.bench``
10. ``trainer.conformance`` — the ms-swift conformance check (``python -m trainer.conformance``): it starts its peers
    with the benchmarks' process groups and builds their random models, and nothing imports it
11. ``trainer.__main__`` (``python -m trainer``)

Three checks: no package-level cycle (the message names it), every edge goes down the layers, and no name that
starts with ``_`` is taken from another package (``from trainer.x.y import _private``, or ``module._private`` on a
module imported from another package). A new package must be placed in ``LAYERS``.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "trainer"

LAYERS: list[tuple[str, ...]] = [
    ("trainer", "trainer.extras", "trainer.telemetry", "trainer.profiling", "trainer.precision"),
    ("trainer.config", "trainer.loggers"),
    ("trainer.data", "trainer.sync", "trainer.buffering", "trainer.memory"),
    ("trainer.matching", "trainer.losses"),
    ("trainer.modeling", "trainer.packing"),
    ("trainer.rollout",),
    ("trainer.server", "trainer.evaluation", "trainer.grpo"),
    ("trainer.sft",),
    ("trainer.launch", "trainer.deploy"),
    ("trainer.cli", "trainer.demo", "trainer.bench"),
    ("trainer.conformance",),
    ("trainer.__main__",),
]

# Known edges that break the rules, each with its owner; the list should be empty. An entry is
# (importing module, imported package).
KNOWN_EDGES: set[tuple[str, str]] = set()


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(module: str) -> str:
    """``trainer.config.schema`` → ``trainer.config``; ``trainer.telemetry`` → itself; ``trainer`` → itself."""
    return ".".join(module.split(".")[:2])


def is_module(name: str, root: Path = ROOT) -> bool:
    rel = Path(*name.split("."))
    return (root / rel).with_suffix(".py").is_file() or (root / rel / "__init__.py").is_file()


def trainer_imports(path: Path, root: Path = ROOT):
    """Yield ``(lineno, imported module, imported name or None, local alias)`` for every ``trainer.*`` import."""
    module = module_name(path, root)
    is_pkg = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "trainer" or alias.name.startswith("trainer."):
                    # `import trainer.a.b` binds `trainer`; `import trainer.a.b as x` binds x to trainer.a.b
                    yield node.lineno, alias.name, None, alias.asname
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "trainer" or target.startswith("trainer."):
                for alias in node.names:
                    yield node.lineno, target, alias.name, alias.asname or alias.name


def scan(root: Path = ROOT):
    """(package edges {src: {dst: [where]}}, private reach-ins [where]) of ``root/trainer``."""
    edges: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    private: list[str] = []
    for path in sorted((root / "trainer").rglob("*.py")):
        module = module_name(path, root)
        src = package_of(module)
        foreign_modules: dict[str, str] = {}  # local name bound to a module of another package
        for lineno, target, name, alias in trainer_imports(path, root):
            submodule = bool(name) and is_module(f"{target}.{name}", root)
            full = f"{target}.{name}" if submodule else target
            dst = package_of(full)
            where = f"{path.relative_to(root)}:{lineno}"
            if dst == src:
                continue
            if (module, dst) not in KNOWN_EDGES:
                edges[src][dst].append(f"{where} ({module} imports {full})")
            hidden = [p for p in full.split(".") if p.startswith("_") and not p.startswith("__")]
            if name and not submodule and name.startswith("_") and not name.startswith("__"):
                hidden.append(name)
            if hidden:
                private.append(f"{where}: {module} imports {target}{'.' + name if name else ''} from another package")
            if alias and (name is None or submodule):
                foreign_modules[alias] = full
        if foreign_modules:
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                        and node.value.id in foreign_modules and node.attr.startswith("_")
                        and not node.attr.startswith("__")):
                    private.append(f"{path.relative_to(root)}:{node.lineno}: {module} uses "
                                   f"{foreign_modules[node.value.id]}.{node.attr} from another package")
    return edges, private


def find_cycle(edges: dict[str, dict[str, list[str]]]) -> list[str] | None:
    """One cycle ``[a, b, …, a]`` of the package graph, or None."""
    color: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        color[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, {})):
            if color.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if color.get(nxt) is None:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        color[node] = 2
        return None

    for node in sorted(edges):
        if color.get(node) is None:
            found = visit(node)
            if found:
                return found
    return None


def test_every_package_has_a_layer():
    layered = {p for layer in LAYERS for p in layer}
    packages = {package_of(module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert not packages - layered, f"place these packages in LAYERS (tests/unit/test_import_layers.py): {sorted(packages - layered)}"


def test_no_import_cycles_between_packages():
    edges, _ = scan()
    cycle = find_cycle(edges)
    if cycle:
        steps = [f"  {a} -> {b}: {edges[a][b][0]}" for a, b in zip(cycle, cycle[1:])]
        raise AssertionError("package import cycle " + " -> ".join(cycle) + "\n" + "\n".join(steps))


def test_imports_go_down_the_layers():
    rank = {p: i for i, layer in enumerate(LAYERS) for p in layer}
    edges, _ = scan()
    bad = [f"{src} (layer {rank[src]}) -> {dst} (layer {rank[dst]}): {where[0]}"
           for src, dsts in sorted(edges.items()) for dst, where in sorted(dsts.items())
           if src in rank and dst in rank and rank[dst] >= rank[src]]
    assert not bad, "imports sideways or up the layers:\n" + "\n".join(bad)


def test_no_private_names_across_packages():
    _, private = scan()
    assert not private, "underscore names used across packages (make them public in their home module):\n" + "\n".join(private)


def test_the_checks_catch_a_cycle_and_a_private_reach_in(tmp_path):
    edges = {"trainer.a": {"trainer.b": ["x"]}, "trainer.b": {"trainer.c": ["y"]}, "trainer.c": {"trainer.a": ["z"]}}
    assert find_cycle(edges) == ["trainer.a", "trainer.b", "trainer.c", "trainer.a"]
    assert find_cycle({"trainer.a": {"trainer.b": ["x"]}}) is None
    for d in ("config", "sft", "grpo"):
        (tmp_path / "trainer" / d).mkdir(parents=True)
        (tmp_path / "trainer" / d / "__init__.py").write_text("")
    (tmp_path / "trainer" / "__init__.py").write_text("")
    (tmp_path / "trainer" / "sft" / "trainer.py").write_text("import trainer.config.schema\n_private = 1\n")
    (tmp_path / "trainer" / "grpo" / "schema.py").write_text("def _pick(): pass\n")
    (tmp_path / "trainer" / "config" / "schema.py").write_text(
        "from trainer.grpo import schema as g\n\ndef f():\n    from trainer.sft.trainer import _private\n"
        "    return g._pick()\n")
    edges, private = scan(tmp_path)
    assert find_cycle(edges) == ["trainer.config", "trainer.sft", "trainer.config"], "function-level imports count"
    assert set(edges["trainer.config"]) == {"trainer.sft", "trainer.grpo"}
    assert any("trainer.sft.trainer._private" in p for p in private)
    assert any("trainer.grpo.schema._pick" in p for p in private)
