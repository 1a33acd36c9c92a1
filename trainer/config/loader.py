"""YAML loading with ``extends``: string or list of paths relative to the including file.

Merge rules: mappings merge deeply (the including file wins), lists and scalars replace, the ``extends``
key itself is consumed. Bases listed in ``extends`` are applied left to right, then the file on top.
Cycles are rejected with the chain that forms them.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from trainer.config.errors import ConfigError


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Return a new mapping: ``override`` merged onto ``base`` (mappings recurse, everything else replaces)."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _read_mapping(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError("", f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError("", f"{path}: not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("", f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data


def resolve_yaml(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Load ``path`` with every ``extends`` resolved; returns a plain dict (not yet validated)."""
    path = Path(path).resolve()
    if path in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, path))
        raise ConfigError("extends", f"cycle in extends: {cycle}")
    data = _read_mapping(path)
    extends = data.pop("extends", None)
    if extends is None:
        bases: list[str] = []
    elif isinstance(extends, str):
        bases = [extends]
    elif isinstance(extends, list) and all(isinstance(b, str) for b in extends):
        bases = extends
    else:
        raise ConfigError("extends", f"{path}: must be a path or a list of paths, got {extends!r}")
    merged: dict[str, Any] = {}
    for base in bases:
        base_path = path.parent / base
        if not base_path.is_file():
            raise ConfigError("extends", f"{base} (from `extends:` in {path}): {base_path.resolve()} "
                                         f"{'is not a file' if base_path.exists() else 'does not exist'}; fix the "
                                         f"path, which is relative to the folder of the file naming it ({path.parent})")
        merged = deep_merge(merged, resolve_yaml(base_path, (*_chain, path)))
    return deep_merge(merged, data)
