"""The held-out split as evaluation loads it: records ``data.on_bad_record: drop`` leaves out are carried into every
result and written, with their ids and reasons, to ``metrics.json`` and ``metrics.md`` (no model: a fake engine)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from PIL import Image

from trainer.evaluation.run import EvalSplit, Evaluator, load_eval_samples, write_eval
from trainer.rollout.types import DecodingParams, RolloutResult


def split_file(root: Path) -> Path:
    Image.new("RGB", (100, 50)).save(root / "a.png")
    good = {"images": ["a.png"], "width": 100, "height": 50, "objects": [{"desc": "cat", "bbox_2d": [1, 2, 30, 40]}]}
    lines = [{**good, "id": "v1"},
             {**good, "id": "v2", "objects": [{"desc": "cat", "bbox_2d": [1, 2, 130, 40]}]},  # outside the image
             {**good, "id": "v1"},  # duplicate
             {**good, "id": "v3"}]
    path = root / "val.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


class FakeCodec:
    """Prompts of one token per sample; every response parses to no objects."""

    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=False: "{}")

    def requests(self, samples):
        return [SimpleNamespace(sample_id=s.sample_id, prompt_token_ids=(1,)) for s in samples], None

    def parse(self, result):
        return SimpleNamespace(broken=False, truncated=False, objects=[], invalid={})


class FakeEngine:
    def generate(self, requests, decoding):
        return [RolloutResult(r.sample_id, (1,), (2,)) for r in requests]


def test_dropped_held_out_records_are_in_metrics_json_and_the_table(tmp_path):
    path = split_file(tmp_path)
    cfg = SimpleNamespace(data=SimpleNamespace(eval_jsonl=str(path), image_root=None, on_bad_record="drop",
                                               synthetic=None))
    split = load_eval_samples(cfg)
    assert isinstance(split, EvalSplit) and [s.sample_id for s in split] == ["v1", "v3"]
    assert [d.sample_id for d in split.dropped] == ["v2", "v1"]
    assert split.dropped[0].reason.startswith(f"{path}:2: objects[0].bbox_2d") and "outside" in split.dropped[0].reason
    assert split.dropped[1].reason == f"{path}:3: duplicate id 'v1' (first at line 1)"

    result = Evaluator(FakeCodec(), FakeEngine(), split, DecodingParams()).run()
    assert result.metrics.num_samples == 2 and result.dropped == split.dropped
    paths = write_eval(tmp_path / "out", result, "fake")
    metrics = json.loads(paths["json"].read_text())
    assert metrics["dropped_records"] == 2 and metrics["num_samples"] == 2
    assert metrics["dropped"] == [{"id": "v2", "reason": split.dropped[0].reason},
                                  {"id": "v1", "reason": f"{path}:3: duplicate id 'v1' (first at line 1)"}]
    table = paths["markdown"].read_text()
    assert "**2 held-out records dropped** by the data checks" in table and "the other 2 samples" in table
    assert f"- v2: {path}:2: objects[0].bbox_2d" in table and f"- v1: {path}:3: duplicate id 'v1'" in table


def test_nothing_dropped_says_so(tmp_path):
    path = split_file(tmp_path)
    path.write_text(path.read_text().splitlines()[0] + "\n")
    cfg = SimpleNamespace(data=SimpleNamespace(eval_jsonl=str(path), image_root=None, on_bad_record="drop",
                                               synthetic=None))
    result = Evaluator(FakeCodec(), FakeEngine(), load_eval_samples(cfg), DecodingParams()).run()
    paths = write_eval(tmp_path / "out", result, "fake")
    metrics = json.loads(paths["json"].read_text())
    assert metrics["dropped_records"] == 0 and metrics["dropped"] == []
    assert "dropped" not in paths["markdown"].read_text()
