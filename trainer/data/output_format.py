"""The assistant output format, serialised in exactly this one place.

``{"object_1": {"desc": "red square", "bbox_2d": [<|coord_12|>, <|coord_40|>, <|coord_77|>, <|coord_90|>]}, ...}``
followed by the chat template's end-of-turn token. Keys ``object_{n}`` count from 1 in appearance order.
The parser (``trainer.matching.parse``) reads this format token by token and never re-serialises.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from trainer.data.objects import NUM_BINS, DetObject

COORD_TOKEN_FORMAT = "<|coord_{}|>"
OBJECT_KEY_PREFIX = "object_"
ITEM_SEPARATOR = ", "


def coord_token(k: int) -> str:
    if not 0 <= k < NUM_BINS:
        raise ValueError(f"coord bin {k} outside [0, {NUM_BINS - 1}]")
    return COORD_TOKEN_FORMAT.format(k)


def all_coord_tokens() -> list[str]:
    return [coord_token(k) for k in range(NUM_BINS)]


def serialize_object(obj: DetObject) -> str:
    """``{"desc": ..., "<kind>": [coords]}``; desc is JSON-escaped, coords are coord tokens."""
    coords = ITEM_SEPARATOR.join(coord_token(c) for c in obj.coords)
    return f'{{"desc": {json.dumps(obj.desc, ensure_ascii=False)}, "{obj.kind}": [{coords}]}}'


def serialize_members(objects: Sequence[DetObject], start_index: int = 1) -> str:
    """The ``"object_n": {...}`` members joined by ``", "``, numbered from ``start_index``; no braces."""
    return ITEM_SEPARATOR.join(
        f'"{OBJECT_KEY_PREFIX}{start_index + i}": {serialize_object(o)}' for i, o in enumerate(objects)
    )


def serialize_objects(objects: Sequence[DetObject]) -> str:
    """The full assistant answer body (without end-of-turn)."""
    return "{" + serialize_members(objects) + "}"


def serialize_append(objects: Sequence[DetObject], start_index: int, prefix_last_char: str) -> str:
    """Text appended after an open rollout prefix: FN members, then the closing ``}``.

    The leading separator depends on the prefix's last non-space character: ``{`` or ``,`` → none,
    ``}`` → ``", "``; anything else is an error (the prefix is not append-ready).
    """
    if prefix_last_char == "{":
        lead = ""
    elif prefix_last_char == ",":
        if not objects:
            raise ValueError("prefix ends with a dangling ',' and there is nothing to append")
        lead = " "
    elif prefix_last_char == "}":
        lead = ITEM_SEPARATOR if objects else ""
    else:
        raise ValueError(f"prefix is not append-ready: last non-space character is {prefix_last_char!r}")
    return lead + serialize_members(objects, start_index) + "}"
