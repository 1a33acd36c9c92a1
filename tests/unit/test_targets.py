"""Target building: Y_train is valid JSON, FN keys continue the numbering, masks cover the intended tokens."""

from __future__ import annotations

import json
import re

import pytest

from trainer.data.objects import DetObject
from trainer.data.output_format import serialize_objects
from trainer.data.records import load_jsonl
from trainer.data.synthetic import generate
from trainer.matching.match import match_objects
from trainer.matching.parse import parse_rollout
from trainer.matching.poly_align import coord_targets
from trainer.matching.targets import IGNORE_INDEX, build_target, ground_truth_target
from trainer.modeling.prompts import PromptEncoder
from trainer.rollout.types import RolloutResult
from trainer.sft.stage2 import Stage2Pipeline, until_first_error

GTS = (
    DetObject("red square", "bbox_2d", (100, 100, 300, 300)),
    DetObject("blue circle", "bbox_2d", (600, 600, 800, 800)),
    DetObject("green triangle", "poly", (400, 50, 500, 200, 300, 200)),
)


@pytest.fixture()
def helpers(tokenizer, vocab):
    def offsets(text):
        e = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(e["input_ids"]), [tuple(o) for o in e["offset_mapping"]]

    return offsets


def build(tokenizer, vocab, offsets, response_text, prompt=(1, 2, 3)):
    ids = vocab.encode(response_text) + [tokenizer.eos_token_id]
    parsed = parse_rollout(ids, vocab)
    m = match_objects([o.to_det() for o in parsed.objects], GTS, 0.3)
    return parsed, m, build_target("s", list(prompt), parsed, m, GTS, tokenizer.eos_token_id, offsets,
                                   dict(vocab.coord_bin_by_id))


def text_of(tokenizer, ids):
    return tokenizer.decode(ids)


def as_json(text):
    return json.loads(re.sub(r"<\|coord_(\d+)\|>", r"\1", text))


def test_prefix_plus_fn_append_is_valid_json_with_continued_keys(tokenizer, vocab, helpers):
    pred = [DetObject("red square", "bbox_2d", (110, 105, 290, 310)), DetObject("ghost", "bbox_2d", (0, 900, 50, 990))]
    resp = serialize_objects(pred).replace('"object_2"', '"object_7"')
    parsed, m, t = build(tokenizer, vocab, helpers, resp)
    assert m.num_matched == 1 and m.false_positives == (1,)
    body = text_of(tokenizer, t.input_ids[3:-1])
    doc = as_json(body)
    assert list(doc) == ["object_1", "object_7", "object_8", "object_9"]
    assert doc["object_8"]["desc"] == "blue circle" and doc["object_9"]["poly"] == list(GTS[2].coords)
    assert t.input_ids[-1] == tokenizer.eos_token_id and t.labels[-1] == tokenizer.eos_token_id
    assert t.stats["matched"] == 1 and t.stats["fn_appended"] == 2 and t.stats["fp"] == 1


def test_tail_desc_ce_labels_the_appended_descriptions_and_nothing_else(tokenizer, vocab, helpers):
    pred = [DetObject("red square", "bbox_2d", (110, 105, 290, 310))]
    ids = vocab.encode(serialize_objects(pred)) + [tokenizer.eos_token_id]
    parsed = parse_rollout(ids, vocab)
    m = match_objects([o.to_det() for o in parsed.objects], GTS, 0.3)
    args = ("s", [1, 2, 3], parsed, m, GTS, tokenizer.eos_token_id, helpers, dict(vocab.coord_bin_by_id))
    off, on = build_target(*args), build_target(*args, desc_ce=True)
    assert off.input_ids == on.input_ids and off.coord_positions == on.coord_positions
    added = [i for i, (a, b) in enumerate(zip(off.labels, on.labels)) if a != b]
    assert added and all(off.labels[i] == IGNORE_INDEX and on.labels[i] == on.input_ids[i] for i in added)
    added_text = "".join(tokenizer.decode([on.input_ids[i]]) for i in added)
    assert "blue" in added_text and "green" in added_text and "red" not in added_text, "tail descs only, not the prefix"


def test_label_masks_cover_exactly_the_intended_tokens(tokenizer, vocab, helpers):
    pred = [DetObject("red square", "bbox_2d", (110, 105, 290, 310))]
    parsed, m, t = build(tokenizer, vocab, helpers, serialize_objects(pred))
    start = t.prompt_len + t.prefix_len
    assert all(lab == IGNORE_INDEX for lab in t.labels[:start]), "prompt and rollout prefix carry no CE"
    coord_ids = set(vocab.coord_bin_by_id)
    tail = list(range(start, len(t.input_ids)))
    ce_tail = [i for i in tail if t.labels[i] != IGNORE_INDEX]
    assert all(t.input_ids[i] not in coord_ids for i in ce_tail), "coord tokens never get CE"
    masked_text = "".join(tokenizer.decode([t.input_ids[i]]) for i in tail if t.labels[i] == IGNORE_INDEX
                          and t.input_ids[i] not in coord_ids)
    assert "blue" in masked_text and "circle" in masked_text and "green" in masked_text
    assert "object" not in masked_text and "desc" not in masked_text
    prefix_coord_pos = [t.prompt_len + p for p in parsed.objects[0].coord_positions]
    tail_coord_pos = [i for i in tail if t.input_ids[i] in coord_ids]
    assert t.coord_positions == prefix_coord_pos + tail_coord_pos
    assert t.coord_targets[:4] == [100.0, 100.0, 300.0, 300.0]
    assert t.coord_targets[4:] == [float(c) for c in GTS[1].coords + GTS[2].coords]
    assert all(t.input_ids[p] in coord_ids for p in t.coord_positions)


def test_unparseable_rollout_appends_every_gt(tokenizer, vocab, helpers):
    parsed, m, t = build(tokenizer, vocab, helpers, "nonsense")
    assert as_json(text_of(tokenizer, t.input_ids[3:-1])) == as_json(serialize_objects(GTS))
    assert t.stats["fn_appended"] == 3 and t.stats["matched"] == 0


def test_ground_truth_target_trains_the_opening_brace(tokenizer, vocab, helpers):
    t = ground_truth_target("s", [1, 2], GTS, tokenizer.eos_token_id, helpers, dict(vocab.coord_bin_by_id))
    assert t.labels[2] == t.input_ids[2] and tokenizer.decode([t.input_ids[2]]).startswith("{")
    assert t.input_ids[2:-1] == tokenizer(serialize_objects(GTS), add_special_tokens=False)["input_ids"], \
        "stage 1 teaches the tokenizer's own tokens for the whole answer"
    ce_text = tokenizer.decode([lab for lab in t.labels if lab != -100])
    assert "red square" in ce_text and "green triangle" in ce_text, "stage-1 trains desc values"
    assert as_json(text_of(tokenizer, t.input_ids[2:-1])) == as_json(serialize_objects(GTS))
    assert len(t.coord_positions) == 4 + 4 + 6


@pytest.mark.parametrize("case", ["stop", "continue", "continue_truncated"])
def test_target_teaches_the_decision_token_the_model_emits(tokenizer, vocab, helpers, case):
    """A rollout that is the ground truth's own tokenisation (all of it: stop; its first object: continue): the
    target's ids equal the tokenizer's ids for the target's text, and the fused decision token after the last kept
    object (``}}`` stop, ``},`` continue) carries CE."""
    full = tokenizer(serialize_objects(GTS), add_special_tokens=False)["input_ids"]
    decision = tokenizer.convert_tokens_to_ids("}}" if case == "stop" else "},")
    if case == "stop":
        response = full + [tokenizer.eos_token_id]
    elif case == "continue":
        response = tokenizer(serialize_objects(GTS[:1]), add_special_tokens=False)["input_ids"]
        response = response + [tokenizer.eos_token_id]
    else:
        response = full[: full.index(decision) + 3]
    parsed = parse_rollout(response, vocab)
    m = match_objects([o.to_det() for o in parsed.objects], GTS, 0.3)
    t = build_target("s", [1, 2, 3], parsed, m, GTS, tokenizer.eos_token_id, helpers, dict(vocab.coord_bin_by_id))
    body = t.input_ids[3:-1]
    assert as_json(tokenizer.decode(body)) == as_json(serialize_objects(GTS))
    assert body == full, "the target's tokens are the tokenizer's tokens for the target's text"
    first_decision = t.prompt_len + t.prefix_len
    assert t.input_ids[first_decision] == decision and t.labels[first_decision] == decision
    assert t.stats["junction_fused"] == 1
    if case == "stop":
        assert t.stats["fn_appended"] == 0 and t.labels[-1] == tokenizer.eos_token_id
        assert [i for i, lab in enumerate(t.labels) if lab != IGNORE_INDEX] == [len(t.labels) - 2, len(t.labels) - 1]
    else:
        assert t.stats["fn_appended"] == 2 and t.stats["matched"] == 1


def test_poly_targets_use_barycentric_projection():
    sq = DetObject("s", "bbox_2d", (100, 100, 300, 300))
    same_square_as_poly = DetObject("s", "poly", (100, 100, 300, 100, 300, 300, 100, 300))
    t = coord_targets(same_square_as_poly, sq, epsilon=0.001, iters=200)
    assert t == pytest.approx([100, 100, 300, 100, 300, 300, 100, 300], abs=1.0)
    t2 = coord_targets(sq, same_square_as_poly, epsilon=0.001, iters=200)
    assert t2 == pytest.approx([100, 100, 300, 300], abs=1.0)
    shifted = DetObject("s", "bbox_2d", (150, 150, 350, 350))
    t3 = coord_targets(DetObject("p", "poly", (150, 150, 350, 150, 350, 350, 150, 350)), shifted, 0.001, 200)
    assert t3 == pytest.approx([150, 150, 350, 150, 350, 350, 150, 350], abs=1.0)


def test_a_broken_answer_is_counted_as_broken_not_as_truncated(tokenizer, tmp_path):
    """``rollout/truncated`` counts decodes the engine cut at the token cap, ``rollout/broken`` answers that stop being
    JSON; a stopped answer with a malformed key is broken only, a capped one truncated only."""
    pipe = Stage2Pipeline(PromptEncoder(tokenizer))
    samples = load_jsonl(generate(tmp_path, 2, seed=0, max_objects=2))
    requests, _ = pipe.requests(samples)
    good = tokenizer(serialize_objects(samples[0].objects[:1]), add_special_tokens=False)["input_ids"]
    broken = good[:-1] + tokenizer('}, "object_2d":", "x"}', add_special_tokens=False)["input_ids"]
    results = [RolloutResult(requests[0].sample_id, tuple(requests[0].prompt_token_ids),
                             tuple(broken + [tokenizer.eos_token_id]), "stop"),
               RolloutResult(requests[1].sample_id, tuple(requests[1].prompt_token_ids), tuple(good[:-4]), "length")]
    stats = [t.stats for t in pipe.targets(samples, requests, results)]
    assert (stats[0]["broken"], stats[0]["truncated"]) == (1, 0)
    assert (stats[1]["broken"], stats[1]["truncated"]) == (0, 1)


def test_until_first_error_keeps_the_objects_before_the_first_false_positive(tokenizer, vocab, helpers):
    """``matching.prefix: until_first_error``: a rollout [match, FP, match] keeps only its first object; the GT the
    dropped match had found is appended again, the junction after the kept object teaches ``},``, and the target's
    ids are the tokenizer's for its text."""
    pred = [DetObject("red square", "bbox_2d", (110, 105, 290, 310)), DetObject("ghost", "bbox_2d", (0, 900, 50, 990)),
            DetObject("blue circle", "bbox_2d", (600, 600, 800, 800))]
    ids = tokenizer(serialize_objects(pred), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    parsed = parse_rollout(ids, vocab)
    m = match_objects([o.to_det() for o in parsed.objects], GTS, 0.3)
    assert m.num_matched == 2 and m.false_positives == (1,)
    cut, cm, dropped = until_first_error(parsed, m, len(GTS), vocab)
    assert dropped == 2 and [o.desc for o in cut.objects] == ["red square"]
    assert cm.pairs == m.pairs[:1] and cm.false_positives == () and cm.false_negatives == (1, 2)
    t = build_target("s", [1, 2, 3], cut, cm, GTS, tokenizer.eos_token_id, helpers, dict(vocab.coord_bin_by_id))
    body = t.input_ids[3:-1]
    assert [o["desc"] for o in as_json(tokenizer.decode(body)).values()] == ["red square", "blue circle",
                                                                             "green triangle"]
    assert body == tokenizer(tokenizer.decode(body), add_special_tokens=False)["input_ids"]
    assert t.input_ids[t.prompt_len + t.prefix_len] == tokenizer.convert_tokens_to_ids("},")
    assert t.stats["matched"] == 1 and t.stats["fn_appended"] == 2

    clean = parse_rollout(tokenizer(serialize_objects(pred[:1]), add_special_tokens=False)["input_ids"], vocab)
    cm2 = match_objects([o.to_det() for o in clean.objects], GTS, 0.3)
    assert until_first_error(clean, cm2, len(GTS), vocab) == (clean, cm2, 0), "no mistake: nothing dropped"


def test_until_first_error_with_a_first_object_wrong_appends_every_gt(tokenizer, vocab, helpers):
    pred = [DetObject("ghost", "bbox_2d", (0, 900, 50, 990)), DetObject("red square", "bbox_2d", (110, 105, 290, 310))]
    parsed = parse_rollout(tokenizer(serialize_objects(pred), add_special_tokens=False)["input_ids"], vocab)
    m = match_objects([o.to_det() for o in parsed.objects], GTS, 0.3)
    cut, cm, dropped = until_first_error(parsed, m, len(GTS), vocab)
    assert dropped == 2 and cut.objects == () and cut.prefix_token_ids == () and cut.junction_text == "{"
    t = build_target("s", [1, 2, 3], cut, cm, GTS, tokenizer.eos_token_id, helpers, dict(vocab.coord_bin_by_id))
    assert t.input_ids[3:-1] == tokenizer(serialize_objects(GTS), add_special_tokens=False)["input_ids"]
