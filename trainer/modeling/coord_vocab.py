"""Tokenizer-derived lookup tables: coord token ids ↔ bins, and the parser's vocabulary."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from trainer.matching.parse import ParseVocab
from trainer.modeling.tokenizer import coord_token_ids, token_bytes_table


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """End-of-turn / EOS / pad ids: decoding stops at the first of them."""
    ids = {tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>"),
           tokenizer.convert_tokens_to_ids("<|endoftext|>")}
    unk = tokenizer.unk_token_id
    return frozenset(i for i in ids if i is not None and i != unk)


def build_parse_vocab(tokenizer: PreTrainedTokenizerBase) -> ParseVocab:
    coords = coord_token_ids(tokenizer)
    special = frozenset(tokenizer.all_special_ids) - set(coords)
    return ParseVocab(
        token_bytes=token_bytes_table(tokenizer),
        coord_bin_by_id={tid: k for k, tid in enumerate(coords)},
        stop_ids=stop_token_ids(tokenizer),
        special_ids=special,
        encode=lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"]),
    )
