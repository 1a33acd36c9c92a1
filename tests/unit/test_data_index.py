"""The line-offset index training loads (``records.index_jsonl``): the eager loader's samples, errors and drops
without keeping records; reads from forked / unpickled copies; a changed file refused; duplicate ids found from
hashes (collisions read back); the exact-resume ledger keyed by record id, not by position."""

from __future__ import annotations

import json
import multiprocessing
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image

from trainer.data.records import DatasetError, LoadReport, duplicates, index_jsonl, load_jsonl
from trainer.data.synthetic import generate


def records_file(tmp_path: Path) -> Path:
    Image.new("RGB", (100, 50)).save(tmp_path / "a.png")
    good = {"images": ["a.png"], "width": 100, "height": 50, "objects": [{"desc": "cat", "bbox_2d": [1, 2, 30, 40]}]}
    lines = [json.dumps({**good, "id": "r1"}), "", json.dumps({**good, "id": 7, "objects": []}),
             json.dumps({**good, "id": "bad", "objects": [{"desc": "", "bbox_2d": [1, 2, 3, 4]}]}), "   ", json.dumps(good),  # no id: file:line
             json.dumps({**good, "id": "r1"}), json.dumps({**good, "id": "r9", "scene": "a cat"})]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_index_gives_the_eager_loaders_samples_errors_and_report(tmp_path):
    path = records_file(tmp_path)
    with pytest.raises(DatasetError) as eager_error:
        load_jsonl(path)
    with pytest.raises(DatasetError) as index_error:
        index_jsonl(path)
    assert str(index_error.value) == str(eager_error.value)
    assert str(index_error.value).startswith(f"2 bad records, the first: {path}:4: objects[0].desc")
    reports = LoadReport(), LoadReport()
    eager = load_jsonl(path, on_bad_record="drop", report=reports[0])
    index = index_jsonl(path, on_bad_record="drop", report=reports[1])
    assert list(index) == eager and reports[0] == reports[1]
    assert [s.sample_id for s in index] == ["r1", "7", f"{path}:6", "r9"]
    assert reports[1].kept == 4 and reports[1].negatives == 1 and len(reports[1].dropped) == 2
    assert reports[1].dropped[1] == f"{path}:7: duplicate id 'r1' (first at line 1)"
    assert index[-1] == eager[-1] and index.where(3) == f"{path}:8" and index.record(1)["id"] == 7
    with pytest.raises(IndexError):
        index[4]


def _ids(dataset) -> list[str]:
    return [s.sample_id for s in dataset]


def test_index_reads_in_forked_workers_and_after_pickling(tmp_path):
    index = index_jsonl(generate(tmp_path, 6, seed=1))
    expected = _ids(index)  # opens the descriptor in this process first
    again = pickle.loads(pickle.dumps(index))
    assert _ids(again) == expected and len(pickle.dumps(index)) < 2000, "no records, no descriptor in the pickle"
    pool = multiprocessing.get_context("fork").Pool(2)
    try:  # bounded, and closed (no SIGTERM to the workers: a handler inherited from the parent could ignore it)
        assert pool.map_async(_ids, [index, index]).get(timeout=120) == [expected, expected]
    finally:
        pool.close()
        pool.join()


def test_a_file_changed_after_indexing_is_refused(tmp_path):
    path = generate(tmp_path, 3, seed=2)
    index = index_jsonl(path)
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[1], lines[0], lines[2]]) + "\n")
    with pytest.raises(DatasetError, match=r":1: the file changed since it was indexed"):
        index[0]


def test_duplicates_confirm_colliding_hashes_by_reading_the_ids_back():
    ids = ["a", "b", "a", "c", "b", "a"]
    read = []

    def id_at(i: int) -> str:
        read.append(i)
        return ids[i]

    assert duplicates([0, 0, 0, 5, 0, 0], id_at) == [(2, 0), (4, 1), (5, 0)]
    assert 3 not in read, "a hash seen once is never read back"
    assert duplicates([1, 2, 3], id_at) == [] and duplicates([], id_at) == []


def test_ledger_rows_are_keyed_by_record_id_whatever_the_position(tmp_path):
    """The trainer's ledger (exact resume, once per epoch) records each trained sample's record id: the index
    hands out ``Sample``s whose ids are the records' own, so a resumed run (a fresh index of the same file) names
    the same samples, and positions shifted by blank or dropped lines never leak into the ledger."""
    from trainer.sft.trainer import LEDGER, RolloutMatchingTrainer, SampleDataset

    path = records_file(tmp_path)
    dataset = SampleDataset(index_jsonl(path, on_bad_record="drop"))
    assert dataset.samples.__class__.__name__ == "JsonlDataset", "kept as the index, not copied into a list"
    fake = SimpleNamespace(is_world_process_zero=lambda: True, state=SimpleNamespace(global_step=3),
                           _steps_per_epoch=2, args=SimpleNamespace(output_dir=str(tmp_path), process_index=0))
    trained = [dataset[i] for i in (3, 0)]
    RolloutMatchingTrainer._record_ledger(fake, [s.sample_id for s in trained], [3, 3])
    rows = [json.loads(line) for line in (tmp_path / LEDGER).read_text().splitlines()]
    assert [(r["sample_id"], r["epoch"], r["step"]) for r in rows] == [("r9", 1, 3), ("r1", 1, 3)]
    resumed = SampleDataset(index_jsonl(path, on_bad_record="drop"))
    assert [resumed[i].sample_id for i in (3, 0)] == [r["sample_id"] for r in rows]
