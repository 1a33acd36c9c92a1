"""Config errors that name the offending key path and say what to do."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config problem at ``key_path`` (dotted, e.g. ``training.packing_length``)."""

    def __init__(self, key_path: str, message: str):
        self.key_path = key_path
        self.message = message
        super().__init__(f"{key_path}: {message}" if key_path else message)


class ConfigErrors(ValueError):
    """Several config problems reported together (all found before any model loads)."""

    def __init__(self, source: str, errors: list[ConfigError]):
        self.source = source
        self.errors = errors
        lines = "\n".join(f"  - {e}" for e in errors)
        super().__init__(f"invalid config {source} ({len(errors)} problem{'s' if len(errors) != 1 else ''}):\n{lines}")
