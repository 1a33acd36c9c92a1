"""``bench --only sync-host`` (quick): every layer count and variant measured, merged LoRA sends the plain model's
names (adapter tensors never leave), JSON and plot written."""

from __future__ import annotations

import json

import pytest

from trainer.bench.sync_host import run


def test_quick_run_measures_plain_and_lora_merged_per_layer_count(tmp_path):
    import torch

    threads = torch.get_num_threads()
    result = run(tmp_path, quick=True)
    assert torch.get_num_threads() == threads, "the bench left its one-thread setting on the caller's process"
    saved = json.loads((tmp_path / "sync_host_quick.json").read_text())
    assert saved == json.loads(json.dumps(result))
    rows = {(r["layers"], r["variant"]): r for r in saved["results"]}
    assert set(rows) == {(n, v) for n in (4, 8) for v in ("plain", "lora-merged")}
    for n in (4, 8):
        assert rows[(n, "plain")]["tensors"] == rows[(n, "lora-merged")]["tensors"] == 11 * n + 3
        for v in ("plain", "lora-merged"):
            r = rows[(n, v)]
            assert r["full_weights_ms"] > 0 and r["check_update_ms"] > 0
            assert r["full_weights_us_per_tensor"] == pytest.approx(r["full_weights_ms"] * 1e3 / r["tensors"])
    assert (tmp_path / "sync_host_quick.png").stat().st_size > 10_000
