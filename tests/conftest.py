"""Shared fixtures: the embedded tokenizer, parse vocab and tiny models (built in code, no hub)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_PLUGINS", "")


@pytest.fixture(scope="session")
def tokenizer():
    from trainer.modeling.fixtures import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture(scope="session")
def vocab(tokenizer):
    from trainer.modeling.coord_vocab import build_parse_vocab

    return build_parse_vocab(tokenizer)
