"""TP-group request gathering of the colocate engine with torch.distributed (gloo, 4 processes, TP=2): one
engine call per group on the group's requests in rank order, each rank gets exactly its own results back."""

from __future__ import annotations

import json
import os

import torch.multiprocessing as mp

from trainer.rollout.vllm_colocate import concat_for_group, tp_groups


def test_tp_groups_and_concat():
    assert tp_groups(4, 2) == [[0, 1], [2, 3]]
    assert tp_groups(3, 1) == [[0], [1], [2]]
    import pytest

    with pytest.raises(ValueError, match="world_size % tensor_parallel_size"):
        tp_groups(6, 4)
    flat, spans = concat_for_group([["a", "b"], [], ["c"]])
    assert flat == ["a", "b", "c"] and spans == [(0, 2), (2, 2), (2, 3)]


def _rank(rank, world, tp, init_file, out_dir):
    import torch.distributed as dist

    from trainer.rollout.types import RolloutRequest, RolloutResult
    from trainer.rollout.vllm_colocate import gather_generate_slice, tp_groups

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    groups = tp_groups(world, tp)
    handles = [dist.new_group(g) for g in groups]
    mine = rank // tp
    calls = []

    def engine_call(reqs):
        calls.append([r.sample_id for r in reqs])
        return [RolloutResult(r.sample_id, r.prompt_token_ids, (len(r.prompt_token_ids), rank), "stop") for r in reqs]

    n_local = rank + 1
    reqs = [RolloutRequest(f"r{rank}-{i}", (), tuple(range(i + 1))) for i in range(n_local)]
    out = gather_generate_slice(reqs, engine_call, handles[mine], tp, groups[mine].index(rank))
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump({"ids": [r.sample_id for r in out], "resp": [list(r.response_token_ids) for r in out], "calls": calls}, f)
    dist.destroy_process_group()


def test_gather_generate_slice_with_gloo(tmp_path):
    mp.start_processes(_rank, args=(4, 2, str(tmp_path / "init"), str(tmp_path)), nprocs=4, join=True,
                       start_method="spawn")
    got = {r: json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)}
    for r in range(4):
        assert got[r]["ids"] == [f"r{r}-{i}" for i in range(r + 1)], "each rank gets its own results, in order"
        assert [resp[0] for resp in got[r]["resp"]] == list(range(1, r + 2))
        group = [0, 1] if r < 2 else [2, 3]
        expected = [f"r{q}-{i}" for q in group for i in range(q + 1)]
        assert got[r]["calls"] == [expected], "one engine call on the group's requests in rank order"
