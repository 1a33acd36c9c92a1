"""Shared fixtures: the embedded tokenizer, parse vocab and a saved tiny model directory (built in code, no hub)."""

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


@pytest.fixture(scope="session")
def tiny_text_dir(tmp_path_factory):
    from trainer.modeling.fixtures import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "text", "text", seed=0)


@pytest.fixture(scope="session")
def tiny_tok(tiny_text_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_text_dir)
