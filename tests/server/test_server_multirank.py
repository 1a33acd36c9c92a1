"""A 2-process learner (torch.distributed, gloo) against real servers: each rank rolls out its own requests,
rank 0 alone pushes weights, and the barrier means no rank rolls out on stale weights; a server failure seen by
one rank only is shared through ``WeightSync``'s quarantine exchange (gathered to rank 0, broadcast back)."""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch.multiprocessing as mp

from tests.server.stall import INFER_TIMEOUT_S, Stall


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

        def begin_sync(self):
            client.begin_sync()

        def end_sync(self):
            client.end_sync()

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


N_STEPS = 8
STEP_S = 1.0  # virtual seconds per step on the ranks' clocks (probe timing without sleeping)
READMIT_AFTER_S = 2.0


def _quarantine_rank_main(rank, world, init_file, urls, model_dir, out_dir, infer_timeout_s):
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from trainer.rollout.server_client import ServerEndpoint, ServerRolloutEngine
    from trainer.rollout.types import DecodingParams, RolloutRequest
    from trainer.server.scripted import tensors_digest
    from trainer.sync.policy import WeightSync
    from trainer.sync.weights import full_weights

    class Clock:
        t = 0.0

        def __call__(self):
            return self.t

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    clock = Clock()
    client = ServerRolloutEngine([ServerEndpoint(u) for u in urls], timeout_s=30, infer_timeout_s=infer_timeout_s,
                                 transport="inband", readmit_after_s=READMIT_AFTER_S, readmit_max_interval_s=8,
                                 clock=clock)
    sync = WeightSync.for_model(client, model, "full")
    records = []
    readmitted = []
    for step in range(N_STEPS):
        torch.manual_seed(step)  # same on both ranks: they hold the same weights, as after an optimizer step
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        clock.t = step * STEP_S
        seen = len(client.readmissions)
        sync.ensure_fresh(model, step)
        readmitted += [[step, r["server"]] for r in client.readmissions[seen:]]
        after_sync = sorted(client.quarantined)
        pushed_to = [s.base_url for s in client.fleet.healthy()] if rank == 0 else None
        reqs = [RolloutRequest(f"r{rank}s{step}i{i}", ({"role": "user", "content": f"rank {rank} step {step} {i}"},),
                               (1, 2, 3, rank, step, i)) for i in range(4)]
        res = client.generate(reqs, DecodingParams(max_new_tokens=8))
        records.append({"step": step, "want": tensors_digest(full_weights(model))[:16],
                        "quarantined_after_sync": after_sync, "pushed_to": pushed_to,
                        "asked": [r.sample_id for r in reqs], "got": [r.sample_id for r in res],
                        "servers": [r.extra["server"] for r in res],
                        "versions": [r.extra["weights_version"] for r in res],
                        "quarantined_after_rollouts": sorted(client.quarantined)})
        dist.barrier()  # stands for the step's gradient all-reduce: no rank syncs while another still rolls out
    out = {"steps": records, "history": sync.history, "readmitted": readmitted,
           "readmissions": [r["server"] for r in client.readmissions]}
    with open(os.path.join(out_dir, f"q-rank{rank}.json"), "w") as f:
        json.dump(out, f)
    client.close()
    dist.destroy_process_group()


def test_failure_seen_by_one_rank_is_shared_at_the_next_sync_and_readmission_reaches_both(serve, tiny_text_dir,
                                                                                        tmp_path):
    """4 servers, 2 ranks: rank 0 rolls out on A and C, rank 1 on B and D (``servers_for_rank``; with 2 or 3 servers
    rank 1 has one server and cannot lose it without losing samples). Two faults, each seen by one rank only:
    - D stalls past ``infer_timeout_s`` on its 2nd /infer/ (step 1; rank 1's rollouts; the stall lasts until the next
      request reaches D, ``tests.server.stall``). The gather must make rank 0 quarantine D at the step-2 sync and push
      nothing to it (D is alive and would take the weights); rank 0 alone probes it once ``readmit_after_s`` has
      passed (step 4), re-syncs it once, and the broadcast brings it back on rank 1, which never probes;
    - B's weight load fails once (step-5 push; rank 0). The broadcast must stop rank 1 sending to B, which holds the
      step-4 weights, until rank 0 re-admits it (step 7)."""
    from trainer.server.app import create_app
    from trainer.server.scripted import ScriptedEngine

    class LoadFailsOnce(ScriptedEngine):
        def __init__(self, fail_on: int):
            super().__init__()
            self.fail_on, self.loads = fail_on, 0

        def load_full(self, tensors):
            self.loads += 1
            if self.loads == self.fail_on:
                raise RuntimeError("out of memory")
            super().load_full(tensors)

    engines = [ScriptedEngine(), LoadFailsOnce(fail_on=6), ScriptedEngine(), ScriptedEngine()]
    stall = Stall(engines[3], calls={2})
    with contextlib.ExitStack() as stack:
        a, b, c, d = urls = [stack.enter_context(serve(app)) for app in
                             [create_app(e) for e in engines[:3]] + [stall.app(create_app(engines[3]))]]
        stack.callback(stall.release)  # before the servers shut down (after a failure the stall may still hold)
        mp.start_processes(_quarantine_rank_main, args=(2, str(tmp_path / "init"), urls, str(tiny_text_dir),
                                                        str(tmp_path), INFER_TIMEOUT_S),
                           nprocs=2, join=True, start_method="spawn")
        assert stall.stalled.is_set() and stall.finished.is_set(), "D's 2nd decode did not stall, or never ended"
        r0 = json.loads((tmp_path / "q-rank0.json").read_text())
        r1 = json.loads((tmp_path / "q-rank1.json").read_text())
        want = [s["want"] for s in r0["steps"]]
        assert [s["want"] for s in r1["steps"]] == want and len(set(want)) == N_STEPS

        for rec in r0["steps"] + r1["steps"]:  # no sample lost, none on stale weights, request order kept
            assert rec["got"] == rec["asked"]
            assert rec["versions"] == [want[rec["step"]]] * 4, rec

        # each fault is observed by one rank; both agree from the next sync until rank 0 re-admits the server
        assert [s["quarantined_after_rollouts"] for s in r0["steps"]][:2] == [[], []]
        assert [s["quarantined_after_rollouts"] for s in r1["steps"]][:2] == [[], [d]]
        agreed = [[], [], [d], [d], [], [b], [b], []]
        assert [s["quarantined_after_sync"] for s in r0["steps"]] == agreed
        assert [s["quarantined_after_sync"] for s in r1["steps"]] == agreed, "rank 1 did not adopt rank 0's set"

        # servers used per step: rank 1 avoids each quarantined server and uses it again once re-admitted
        assert [s["servers"] for s in r0["steps"]] == [[a, a, c, c]] * N_STEPS
        assert [s["servers"] for s in r1["steps"]] == [[b, b, d, d], [b] * 4, [b] * 4, [b] * 4,
                                                        [b, b, d, d], [d] * 4, [d] * 4, [b, b, d, d]]

        # rank 0 alone pushes, never to a quarantined server; each server gets exactly one re-sync when re-admitted
        assert [s["pushed_to"] for s in r0["steps"]] == [urls, urls, [a, b, c], [a, b, c], urls, [a, c, d],
                                                         [a, c, d], urls]
        assert [s["pushed_to"] for s in r1["steps"]] == [None] * N_STEPS and r1["history"] == []
        assert [h[0] for h in r0["history"]] == list(range(N_STEPS))
        assert r0["readmitted"] == [[4, d], [7, b]] and r0["readmissions"] == [d, b]
        assert r1["readmitted"] == [] and r1["readmissions"] == []
        for e in (engines[0], engines[2]):
            assert [u["digest"][:16] for u in e.updates] == want
        assert [u["digest"][:16] for u in engines[1].updates] == want[:5] + [want[7]]
        assert [u["digest"][:16] for u in engines[3].updates] == want[:2] + want[4:]
        assert engines[3].generate_calls == 6, "D served rank 1 at steps 0, 1 (stalled) and 4-7 only"

if __name__ == "__main__":
    pytest.main([__file__])
