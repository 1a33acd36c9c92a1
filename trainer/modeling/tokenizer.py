"""The embedded tokenizer: byte-level BPE trained in code on the task's own text, plus the coord tokens
``<|coord_0|>``…``<|coord_999|>`` and Qwen-style chat/vision special tokens. No hub access needed.

Also ``token_bytes_table``: the exact bytes each token id stands for, which the strict parser scans
token by token (never decode-then-re-encode).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from trainer.data.output_format import all_coord_tokens

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 800, coord_tokens: bool = True) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``corpus`` and wrap it as a transformers fast tokenizer (deterministic).
    ``coord_tokens=False``: a stock tokenizer (the same ids, without the 1000 coord tokens appended)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sorted(set(corpus)), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=SPECIAL_TOKENS[1:],
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    if coord_tokens:
        hf.add_tokens(all_coord_tokens())
    hf.chat_template = CHAT_TEMPLATE
    return hf


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes_table(tokenizer: PreTrainedTokenizerBase) -> list[bytes]:
    """``table[id]`` = the raw bytes of token ``id`` (byte-level BPE pieces decoded; added tokens as UTF-8)."""
    size = len(tokenizer)
    decoder = _byte_decoder()
    added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
    table: list[bytes] = []
    pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
    for i, piece in enumerate(pieces):
        if i in added:
            table.append(added[i].encode("utf-8"))
        elif piece is None:
            table.append(b"")
        elif all(ch in decoder for ch in piece):
            table.append(bytes(decoder[ch] for ch in piece))
        else:
            table.append(tokenizer.decode([i]).encode("utf-8"))
    return table


class MissingCoordTokens(ValueError):
    """The tokenizer lacks some or all of ``<|coord_0|>``…``<|coord_999|>`` (``missing``: how many)."""

    def __init__(self, missing: list[int]):
        self.missing = missing
        super().__init__(
            f"tokenizer lacks {len(missing)} coord tokens (first: <|coord_{missing[0]}|>); "
            "add <|coord_0|>..<|coord_999|> to the tokenizer and resize the model embeddings"
        )


def missing_coord_bins(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The bins ``k`` whose ``<|coord_k|>`` is not a token of ``tokenizer`` (empty: all 1000 present)."""
    ids = tokenizer.convert_tokens_to_ids(all_coord_tokens())
    unk = getattr(tokenizer, "unk_token_id", None)
    return [k for k, i in enumerate(ids) if i is None or (unk is not None and i == unk)]


def coord_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids of ``<|coord_0|>``…``<|coord_999|>`` in bin order; ``MissingCoordTokens`` if the tokenizer lacks any."""
    missing = missing_coord_bins(tokenizer)
    if missing:
        raise MissingCoordTokens(missing)
    return list(tokenizer.convert_tokens_to_ids(all_coord_tokens()))
