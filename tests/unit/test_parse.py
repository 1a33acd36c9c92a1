"""Strict token-aligned parser: hand-written cases and fuzzed token sequences."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainer.data.objects import DetObject
from trainer.data.output_format import serialize_append, serialize_objects
from trainer.matching.parse import parse_rollout

OBJS = [
    DetObject("red square", "bbox_2d", (10, 20, 300, 400)),
    DetObject("blue circle", "poly", (5, 6, 70, 8, 9, 100)),
    DetObject("green triangle", "bbox_2d", (500, 510, 700, 900)),
]


def enc(vocab, text):
    return vocab.encode(text)


def decode(vocab, ids):
    return b"".join(vocab.token_bytes[i] for i in ids).decode("utf-8")


def as_json(text: str):
    return json.loads(re.sub(r"<\|coord_(\d+)\|>", r"\1", text))


def kept_text(vocab, result):
    """The target's text up to the FN append: the verbatim prefix, then the junction."""
    return decode(vocab, result.prefix_token_ids) + result.junction_text


def y_train_text(vocab, result, fn):
    return kept_text(vocab, result) + serialize_append(fn, result.max_object_index + 1, result.prefix_last_char)


def test_roundtrip_positions_point_at_coord_tokens(vocab, tokenizer):
    ids = enc(vocab, serialize_objects(OBJS)) + [tokenizer.eos_token_id]
    r = parse_rollout(ids, vocab)
    assert [o.to_det() for o in r.objects] == OBJS
    assert r.invalid == {} and r.stopped and not r.truncated and not r.broken
    for o in r.objects:
        assert [vocab.coord_bin_by_id[ids[p]] for p in o.coord_positions] == list(o.coords)
    assert r.max_object_index == 3
    text = kept_text(vocab, r)
    assert text.endswith("]}") and as_json(text + "}") == as_json(serialize_objects(OBJS))


def test_the_decision_token_is_never_kept_in_the_prefix(vocab, tokenizer):
    """Stop (``}}``) and continue (``},``): the prefix ends before the fused token and the junction is its text up
    to the cut, so the target re-tokenises it whole instead of keeping a lone ``}``."""
    ids = enc(vocab, serialize_objects(OBJS))
    pieces = [vocab.token_bytes[i] for i in ids]
    assert b"}," in pieces and b"}}" in pieces, "the embedded tokenizer must fuse }, and }} for this test"
    r = parse_rollout(ids, vocab)
    assert ids[-1] == tokenizer.convert_tokens_to_ids("}}")
    assert list(r.prefix_token_ids) == ids[:-1] and r.junction_text == "}" and r.junction_fused
    fused = ids.index(tokenizer.convert_tokens_to_ids("},"))
    r1 = parse_rollout(ids[: fused + 1], vocab)
    assert list(r1.prefix_token_ids) == ids[:fused] and r1.junction_text == "}" and r1.junction_fused
    assert decode(vocab, r1.prefix_token_ids).endswith("]") and len(r1.objects) == 1


def test_a_lone_closing_brace_is_re_tokenised_too(vocab):
    """A rollout that emitted ``}`` and ``,`` separately: the prefix still ends before the ``}``, not fused."""
    lone = vocab.encode("}")
    assert len(lone) == 1
    ids = enc(vocab, serialize_objects(OBJS[:1])[:-2]) + lone + vocab.encode(",")
    r = parse_rollout(ids, vocab)
    assert len(r.objects) == 1 and r.junction_text == "}" and not r.junction_fused
    assert list(r.prefix_token_ids) == ids[:-2]


def test_every_truncation_gives_an_append_ready_prefix(vocab):
    ids = enc(vocab, serialize_objects(OBJS))
    for k in range(len(ids) + 1):
        r = parse_rollout(ids[:k], vocab)
        assert [o.to_det() for o in r.objects] == OBJS[: len(r.objects)]
        n = len(r.prefix_token_ids)
        assert list(r.prefix_token_ids) == ids[:n], "the prefix is the response's own tokens"
        assert r.junction_text == ("}" if r.objects else "{")
        fn = OBJS[len(r.objects):]
        doc = as_json(y_train_text(vocab, r, fn))
        assert list(doc) == [f"object_{i}" for i in range(1, 4)]
        assert r.truncated == (k < len(ids))


@pytest.mark.parametrize(
    "bad, reason",
    [
        ('"object_2": {"bbox_2d": [<|coord_1|>, <|coord_2|>, <|coord_3|>, <|coord_4|>]}', "missing_desc"),
        ('"object_2": {"desc": "", "bbox_2d": [<|coord_1|>, <|coord_2|>, <|coord_3|>, <|coord_4|>]}', "missing_desc"),
        ('"object_2": {"desc": "x", "bbox_2d": [<|coord_1|>, <|coord_2|>, <|coord_3|>]}', "bbox_count"),
        ('"object_2": {"desc": "x", "poly": [<|coord_1|>, <|coord_2|>, <|coord_3|>, <|coord_4|>, <|coord_5|>]}', "poly_count"),
        ('"object_2": {"desc": "x", "poly": [<|coord_1|>, <|coord_2|>, <|coord_3|>, <|coord_4|>]}', "poly_count"),
        ('"object_2": {"desc": "x", "bbox_2d": [<|coord_1|>, 7, <|coord_3|>, <|coord_4|>]}', "non_coord_in_geometry"),
        ('"object_2": {"desc": "x", "color": "red", "bbox_2d": [<|coord_1|>, <|coord_2|>, <|coord_3|>, <|coord_4|>]}', "extra_key"),
        ('"object_2": {"desc": "x", "bbox_2d": [<|coord_1|>, <|coord_2|>, <|coord_3|>, <|coord_4|>], '
         '"poly": [<|coord_1|>, <|coord_2|>, <|coord_3|>, <|coord_4|>, <|coord_5|>, <|coord_6|>]}', "two_geometries"),
        ('"object_2": {"desc": {"name": "x"}, "bbox_2d": [<|coord_1|>, <|coord_2|>, <|coord_3|>, <|coord_4|>]}', "desc_not_string"),
        ('"object_2": {"desc": "x", "bbox_2d": [[<|coord_1|>, <|coord_2|>], <|coord_3|>, <|coord_4|>]}', "non_coord_in_geometry"),
        ('"object_2": {"desc": "x"}', "no_geometry"),
        ('"thing": {"desc": "x", "bbox_2d": [<|coord_1|>, <|coord_2|>, <|coord_3|>, <|coord_4|>]}', "bad_key"),
        ('"object_1": {"desc": "x", "bbox_2d": [<|coord_1|>, <|coord_2|>, <|coord_3|>, <|coord_4|>]}', "duplicate_key"),
    ],
)
def test_malformed_middle_object_is_dropped_and_counted(vocab, bad, reason):
    good1 = '"object_1": {"desc": "a", "bbox_2d": [<|coord_1|>, <|coord_2|>, <|coord_3|>, <|coord_4|>]}'
    good3 = '"object_3": {"desc": "c", "bbox_2d": [<|coord_5|>, <|coord_6|>, <|coord_7|>, <|coord_8|>]}'
    text = "{" + good1 + ", " + bad + ", " + good3 + "}"
    r = parse_rollout(enc(vocab, text), vocab)
    assert [o.desc for o in r.objects] == ["a", "c"]
    assert r.invalid == {reason: 1}
    assert kept_text(vocab, r) == text[:-1], "no repair: the invalid object stays in the prefix"
    assert r.max_object_index == 3


def test_keys_out_of_order_and_appearance_order(vocab):
    text = ('{"object_3": {"bbox_2d": [<|coord_1|>, <|coord_2|>, <|coord_3|>, <|coord_4|>], "desc": "late key"}, '
            '"object_1": {"desc": "b", "bbox_2d": [<|coord_5|>, <|coord_6|>, <|coord_7|>, <|coord_8|>]}}')
    r = parse_rollout(enc(vocab, text), vocab)
    assert [(o.index, o.desc) for o in r.objects] == [(3, "late key"), (1, "b")]
    assert r.max_object_index == 3


def test_no_brace_means_an_empty_prefix_and_an_open_brace_junction(vocab, tokenizer):
    r = parse_rollout(enc(vocab, "I see a red square.") + [tokenizer.eos_token_id], vocab)
    assert r.prefix_token_ids == () and r.junction_text == "{" and r.prefix_last_char == "{"
    assert r.objects == () and r.broken
    assert as_json(y_train_text(vocab, r, OBJS)) == as_json(serialize_objects(OBJS))


def test_everything_after_end_of_turn_is_ignored(vocab, tokenizer):
    ids = enc(vocab, serialize_objects(OBJS[:1])) + [tokenizer.eos_token_id] + enc(vocab, serialize_objects(OBJS))
    r = parse_rollout(ids, vocab)
    assert len(r.objects) == 1 and r.stopped and not r.truncated


def test_garbage_between_objects_breaks_the_stream_at_the_last_clean_cut(vocab):
    text = serialize_objects(OBJS[:1])[:-1] + " oops " + serialize_objects(OBJS[1:])[1:]
    r = parse_rollout(enc(vocab, text), vocab)
    assert [o.to_det() for o in r.objects] == OBJS[:1] and r.broken
    assert kept_text(vocab, r) == serialize_objects(OBJS[:1])[:-1]


def test_escaped_desc_is_decoded(vocab):
    obj = DetObject('a "quoted" \\ thing', "bbox_2d", (1, 2, 3, 4))
    r = parse_rollout(enc(vocab, serialize_objects([obj])), vocab)
    assert r.objects[0].desc == obj.desc


def _mutate(ids, ops, vocab_size):
    out = list(ids)
    for kind, pos, tok in ops:
        if not out:
            break
        pos %= len(out)
        if kind == 0:
            del out[pos]
        elif kind == 1:
            out.insert(pos, tok % vocab_size)
        else:
            out[pos] = tok % vocab_size
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 10_000), st.integers(0, 10_000)), max_size=6),
       cut=st.integers(0, 200))
def test_fuzzed_rollouts_never_raise_and_yield_valid_targets(vocab, ops, cut):
    base = enc(vocab, serialize_objects(OBJS))
    ids = _mutate(base, ops, len(vocab.token_bytes))[: max(1, len(base) - cut % 40)]
    r = parse_rollout(ids, vocab)
    assert r.num_predicted >= len(r.objects)
    for o in r.objects:
        assert all(ids[p] in vocab.coord_bin_by_id for p in o.coord_positions)
        assert max(o.coord_positions) < len(r.prefix_token_ids)
    doc = as_json(y_train_text(vocab, r, OBJS))
    assert len(doc) == len(set(doc))
    assert f"object_{r.max_object_index + 1}" in doc


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ids=st.lists(st.integers(0, 1799), max_size=60))
def test_random_token_soup_never_raises(vocab, ids):
    r = parse_rollout(ids, vocab)
    assert kept_text(vocab, r)[0] == "{"
    as_json(y_train_text(vocab, r, OBJS[:1]))
