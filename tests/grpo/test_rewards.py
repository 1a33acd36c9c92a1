"""Summary rewards on hand-written answers; expected values are worked out by hand in the comments."""

from __future__ import annotations

import json

import pytest

from trainer.grpo.rewards import REWARD_NAMES, Reference, RewardContext, reference_from_row, score, tversky
from trainer.grpo.schema_tree import derive_schema_tree, score_schema_tree
from trainer.grpo.summary_format import IRRELEVANT_LINE, parse_answer

BBU_REF = {"dataset": "BBU",
           "统计": [{"类别": "BBU设备", "品牌": {"华为": 1}, "可见性": {"完整": 1}},
                  {"类别": "标签", "可读性": {"清晰": 2}, "文本": ["BBU-01", "GND"]}],
           "备注": ["机柜门未关闭"]}
RRU_REF = {"dataset": "RRU",
           "统计": [{"类别": "RRU设备", "品牌": {"华为": 1}, "安装": {"方向": {"竖直": 1}, "抱杆": {"是": 1}}},
                  {"类别": "紧固件", "状态": {"齐全": 2}}],
           "分组统计": {"1组": {"RRU设备": 1, "紧固件": 2}}}
HEADER = {"BBU": "<DOMAIN=BBU>, <TASK=SUMMARY>", "RRU": "<DOMAIN=RRU>, <TASK=SUMMARY>"}


def answer(domain: str, summary: dict | str) -> str:
    body = summary if isinstance(summary, str) else json.dumps(summary, ensure_ascii=False)
    return f"{HEADER[domain]}\n{body}"


def with_entries(ref: dict, entries: list[dict], **extra) -> dict:
    out = {k: v for k, v in ref.items() if k != "统计"}
    out["统计"] = entries
    out.update(extra)
    return out


BBU = Reference("BBU", BBU_REF)
RRU = Reference("RRU", RRU_REF)
IRRELEVANT = Reference(None, None)


def scores(completion: str, ref: Reference, names=REWARD_NAMES, ctx=None) -> dict[str, float]:
    return {n: score(n, completion, ref, ctx) for n in names if n != "summary.schema_tree"}


def test_perfect_bbu_answer():
    s = scores(answer("BBU", BBU_REF) + "\n", BBU)  # a trailing newline is tolerated
    assert s["summary.format"] == 1 and s["summary.header"] == 1 and s["summary.dataset"] == 1
    assert s["summary.strict"] == 0 and s["summary.parse"] == 0 and s["summary.no_dup_keys"] == 0
    assert s["summary.category_recall"] == 1 and s["summary.content_structured_tversky"] == 1
    assert s["summary.text_bbu"] == 1 and s["summary.notes_bbu"] == 1
    assert s["summary.attr_key_recall"] == 1 and s["summary.attr_path_recall"] == 1
    assert s["summary.group_stats_presence"] == 0  # RRU-only


def test_wrong_header_domain():
    s = scores(answer("RRU", BBU_REF), BBU)
    assert s["summary.format"] == 1  # the shape still holds
    assert s["summary.header"] == 0
    assert s["summary.strict"] == 0


def test_three_lines_break_the_contract():
    text = answer("BBU", BBU_REF) + "\n补充说明"
    s = scores(text, BBU)
    assert s["summary.format"] == 0 and s["summary.strict"] == -1
    assert s["summary.header"] == 1  # the first line is still the exact header
    assert s["summary.category_recall"] == 0 and s["summary.content_structured_tversky"] == 0  # gated


def test_header_only_and_empty_answers():
    for text in (HEADER["BBU"], ""):
        s = scores(text, BBU)
        assert s["summary.format"] == 0 and s["summary.strict"] == -1 and s["summary.parse"] == -1


def test_unparseable_json_line():
    s = scores(answer("BBU", '{"dataset": "BBU", "统计": [}'), BBU)
    assert s["summary.format"] == 1 and s["summary.parse"] == -1
    assert s["summary.dataset"] == 0 and s["summary.no_dup_keys"] == 0


def test_json_array_is_not_a_summary():
    assert score("summary.parse", answer("BBU", "[1, 2]"), BBU) == -1


def test_duplicate_keys_at_depth():
    nested = '{"dataset": "BBU", "统计": [{"类别": "螺丝", "状态": {"拧紧": 1}, "状态": {"松动": 1}}]}'
    assert parse_answer(answer("BBU", nested)).duplicate_keys == ("状态",)
    assert score("summary.no_dup_keys", answer("BBU", nested), BBU) == -1
    assert score("summary.parse", answer("BBU", nested), BBU) == 0
    top = '{"dataset": "BBU", "dataset": "RRU", "统计": []}'
    assert score("summary.no_dup_keys", answer("BBU", top), BBU) == -1


def test_irrelevant_reference():
    s = scores(IRRELEVANT_LINE, IRRELEVANT)
    assert s["summary.format"] == 1
    assert all(v == 0 for k, v in s.items() if k != "summary.format")
    s = scores(answer("BBU", BBU_REF), IRRELEVANT)
    assert s["summary.header"] == -1  # an irrelevant answer must not carry a header
    assert s["summary.strict"] == 0 and s["summary.parse"] == 0 and s["summary.category_recall"] == 0
    assert score("summary.header", "<DOMAIN=BBU>\n" + IRRELEVANT_LINE, IRRELEVANT) == -1


def test_irrelevant_line_for_a_relevant_image():
    s = scores(IRRELEVANT_LINE, BBU)
    assert s["summary.format"] == 1 and s["summary.strict"] == -1 and s["summary.parse"] == -1
    assert s["summary.header"] == 0 and s["summary.category_recall"] == 0


def test_dataset_field_must_equal_domain():
    assert score("summary.dataset", answer("BBU", dict(BBU_REF, dataset="RRU")), BBU) == 0


def test_category_recall_half():
    pred = with_entries(BBU_REF, BBU_REF["统计"][:1])
    assert score("summary.category_recall", answer("BBU", pred), BBU) == 0.5


def test_tversky_counts_and_alpha_by_domain():
    # BBU facts (文本/备注 excluded): 品牌华为 1 + 可见性完整 1 + 可读性清晰 2 = 4
    missing_label = with_entries(BBU_REF, BBU_REF["统计"][:1])  # 2 hit, 2 missed: 2 / (2 + 1.0·2)
    assert score("summary.content_structured_tversky", answer("BBU", missing_label), BBU) == pytest.approx(0.5)
    extra = json.loads(json.dumps(BBU_REF))
    extra["统计"][0]["品牌"]["中兴"] = 1  # one false-positive fact: 4 / (4 + 0.3·1)
    assert score("summary.content_structured_tversky", answer("BBU", extra), BBU) == pytest.approx(4 / 4.3)
    ocr_only_change = json.loads(json.dumps(BBU_REF))
    ocr_only_change["统计"][1]["文本"] = ["OTHER"]
    ocr_only_change["备注"] = ["别的"]
    assert score("summary.content_structured_tversky", answer("BBU", ocr_only_change), BBU) == 1.0
    # RRU facts: 品牌 1 + 安装.方向 1 + 安装.抱杆 1 + 状态 2 + 分组统计 (1 + 2) = 8; α = 0.6
    rru_extra = json.loads(json.dumps(RRU_REF))
    rru_extra["统计"][1]["状态"]["缺失"] = 1
    assert score("summary.content_structured_tversky", answer("RRU", rru_extra), RRU) == pytest.approx(8 / 8.6)
    undercount = json.loads(json.dumps(RRU_REF))
    undercount["统计"][1]["状态"]["齐全"] = 1  # 7 hit, 1 missed
    assert score("summary.content_structured_tversky", answer("RRU", undercount), RRU) == pytest.approx(7 / 8)


def test_tversky_function_edges():
    from collections import Counter

    assert tversky(Counter(), Counter(), 0.3, 1.0) == 1.0
    assert tversky(Counter({"a": 1}), Counter(), 0.3, 1.0) == 0.0


def test_text_bbu_recall_normalisation_and_extra_penalty():
    def with_texts(texts):
        out = json.loads(json.dumps(BBU_REF))
        out["统计"][1]["文本"] = texts
        return answer("BBU", out)

    assert score("summary.text_bbu", with_texts(["bbu 01", "gnd"]), BBU) == 1.0  # case/space/punct-insensitive
    assert score("summary.text_bbu", with_texts(["BBU-01"]), BBU) == 0.5
    # 5 unique texts vs 2 in the reference: 2 + 2 free, 1 extra → 1.0 − 0.1
    assert score("summary.text_bbu", with_texts(["BBU-01", "GND", "X1", "X2", "X3"]), BBU) == pytest.approx(0.9)
    assert score("summary.text_bbu", answer("RRU", RRU_REF), RRU) == 0


def test_notes_bbu():
    assert score("summary.notes_bbu", answer("BBU", dict(BBU_REF, 备注=["机柜门未关闭。"])), BBU) == 1.0
    assert score("summary.notes_bbu", answer("BBU", {k: v for k, v in BBU_REF.items() if k != "备注"}), BBU) == 0.0
    no_notes = Reference("BBU", {k: v for k, v in BBU_REF.items() if k != "备注"})
    assert score("summary.notes_bbu", answer("BBU", BBU_REF), no_notes) == -1.0
    assert score("summary.notes_bbu", answer("BBU", no_notes.summary), no_notes) == 0.0


def test_group_stats_presence():
    assert score("summary.group_stats_presence", answer("RRU", RRU_REF), RRU) == 1
    without = {k: v for k, v in RRU_REF.items() if k != "分组统计"}
    assert score("summary.group_stats_presence", answer("RRU", without), RRU) == 0
    assert score("summary.group_stats_presence", answer("RRU", RRU_REF), Reference("RRU", without)) == 0


def test_attr_key_recall():
    pred = json.loads(json.dumps(BBU_REF))
    del pred["统计"][0]["可见性"]  # 3 of 4 (category, key) pairs
    assert score("summary.attr_key_recall", answer("BBU", pred), BBU) == 0.75


def test_attr_path_recall_over_shared_categories():
    pred = json.loads(json.dumps(RRU_REF))
    del pred["统计"][0]["安装"]["抱杆"]
    del pred["统计"][1]  # 紧固件 not emitted: its paths do not count
    # RRU设备 paths: 品牌, 安装, 安装.方向, 安装.抱杆 → 3 of 4
    assert score("summary.attr_path_recall", answer("RRU", pred), RRU) == 0.75
    other = with_entries(RRU_REF, [{"类别": "尾纤", "防水": {"已处理": 1}}])
    assert score("summary.attr_path_recall", answer("RRU", other), RRU) == 0


CORPUS = [
    {"统计": [{"类别": "螺丝", "状态": {"拧紧": 1}}, {"类别": "标签", "可读性": {"清晰": 1}, "文本": ["A"]}]},
    {"统计": [{"类别": "螺丝", "状态": {"松动": 2}, "位置": {"左": 2}}]},
    None,  # an irrelevant row
]


def test_schema_tree_is_derived_from_the_corpus():
    tree = derive_schema_tree(CORPUS)
    assert tree.required == {"螺丝": frozenset({"状态"}), "标签": frozenset({"可读性", "文本"})}
    assert tree.allowed["螺丝"] == frozenset({"状态", "位置"})


def test_schema_tree_score():
    tree = derive_schema_tree(CORPUS)
    screw = {"类别": "螺丝", "状态": {"拧紧": 1}}
    assert score_schema_tree({"统计": [screw]}, tree) == 1.0
    assert score_schema_tree({"统计": [{"类别": "标签", "可读性": {"清晰": 1}}]}, tree) == 0.5
    assert score_schema_tree({"统计": [dict(screw, 颜色={"黑": 1})]}, tree) == pytest.approx(0.9)
    assert score_schema_tree({"统计": [screw, {"类别": "天线", "x": {"y": 1}}]}, tree) == pytest.approx(0.75)
    assert score_schema_tree({"统计": []}, tree) == 0.0
    ctx = RewardContext(schema_tree=tree)
    ref = Reference("BBU", {"dataset": "BBU", "统计": [screw]})
    assert score("summary.schema_tree", answer("BBU", {"dataset": "BBU", "统计": [screw]}), ref, ctx) == 1.0
    with pytest.raises(ValueError, match="schema tree"):
        score("summary.schema_tree", answer("BBU", ref.summary), ref)


def test_reference_from_row():
    assert reference_from_row(IRRELEVANT_LINE, {"domain": None}) == IRRELEVANT
    ref = reference_from_row(answer("RRU", RRU_REF), {"domain": "RRU"})
    assert ref.domain == "RRU" and ref.summary == RRU_REF
    with pytest.raises(ValueError, match="summary_ref"):
        reference_from_row("garbage", {})


def test_unknown_reward_name():
    with pytest.raises(KeyError, match="summary.nope"):
        score("summary.nope", "", BBU)
