"""A 2-process learner (torch.distributed, gloo) against real servers: each rank rolls out its own requests,
rank 0 alone pushes weights, and the barrier means no rank rolls out on stale weights."""

from __future__ import annotations

import json
import os

import pytest
import torch.multiprocessing as mp


def _rank_main(rank, world, init_file, urls, model_dir, out_dir):
    import time

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.rollout.server_client import ServerEndpoint, ServerRolloutEngine
    from trainer.rollout.types import DecodingParams, RolloutRequest
    from trainer.server.scripted import tensors_digest
    from trainer.sync.policy import WeightSync
    from trainer.sync.weights import full_weights

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    client = ServerRolloutEngine([ServerEndpoint(u) for u in urls], timeout_s=30, transport="inband")

    class SlowPush:
        """Rank 0 pushes late, so a rank that skipped the barrier would see the old weights."""

        syncs_on_every_rank = False

        def supports_adapter_sync(self):
            return client.supports_adapter_sync()

        def sync_full(self, m, merge_adapter=True):
            time.sleep(1.0)
            client.sync_full(m, merge_adapter)

        def sync_adapter(self, m):
            client.sync_adapter(m)

    sync = WeightSync.for_model(SlowPush(), model, "full")
    records = []
    for step in range(2):
        torch.manual_seed(step)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        sync.ensure_fresh(model, step)
        msgs = ({"role": "user", "content": f"rank {rank} step {step}"},)
        text = tok.apply_chat_template(list(msgs), tokenize=False, add_generation_prompt=True)
        req = RolloutRequest(f"r{rank}s{step}", msgs, tuple(tok(text, add_special_tokens=False)["input_ids"]))
        res = client.generate([req, req], DecodingParams(max_new_tokens=16))
        records.append({"step": step, "versions": [r.extra["weights_version"] for r in res],
                        "servers": [r.extra["server"] for r in res],
                        "want": tensors_digest(full_weights(model))[:16], "pushed": len(sync.history)})
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(records, f)
    dist.destroy_process_group()


def test_two_rank_learner_rank0_syncs_and_nobody_rolls_out_stale(scripted_server, tiny_text_dir, tmp_path):
    with scripted_server(tiny_text_dir) as (u0, e0), scripted_server(tiny_text_dir) as (u1, e1):
        mp.start_processes(_rank_main, args=(2, str(tmp_path / "init"), [u0, u1], str(tiny_text_dir), str(tmp_path)),
                           nprocs=2, join=True, start_method="spawn")
        r0 = json.loads((tmp_path / "rank0.json").read_text())
        r1 = json.loads((tmp_path / "rank1.json").read_text())
        for rec0, rec1 in zip(r0, r1):
            assert rec0["want"] == rec1["want"], "ranks hold the same weights"
            assert rec0["versions"] == [rec0["want"]] * 2
            assert rec1["versions"] == [rec1["want"]] * 2, "rank 1 rolled out on stale weights"
        assert [r["servers"] for r in r0] == [[u0, u0]] * 2 and [r["servers"] for r in r1] == [[u1, u1]] * 2
        assert [r["pushed"] for r in r0] == [1, 2] and [r["pushed"] for r in r1] == [0, 0]
        assert len(e0.updates) == len(e1.updates) == 2


if __name__ == "__main__":
    pytest.main([__file__])
