"""``trainer.bench.inband`` pieces on a 1 MiB payload against an in-process scripted server (the full
``bench --only inband --quick`` starts a server subprocess and takes ~20 s here, so it is not run as a test)."""

from __future__ import annotations

import httpx

from trainer.bench import inband
from trainer.rollout.server_client import ServerEndpoint
from trainer.sync.transports import InbandTransport


def test_inband_bench_pushes_are_read_whole_and_refused(serve, tiny_text_dir, tmp_path):
    tensors = inband.payload(2**20, n_tensors=4)
    assert inband._nbytes(tensors) == 2**20 and len(tensors) == 4
    assert inband.raw_copy(tensors) > 0
    from trainer.server.app import create_app
    from trainer.server.scripted import ScriptedEngine

    engine = ScriptedEngine(tiny_text_dir)
    with serve(create_app(engine, shm_dir=str(tmp_path))) as url:
        transport = InbandTransport(timeout_s=60)
        shm = InbandTransport(timeout_s=60, shm_dir=str(tmp_path))
        try:
            after = inband.push_after(transport, ServerEndpoint(url), tensors)
            staged = inband.push_after(shm, ServerEndpoint(url), tensors)
        finally:
            transport.close()
            shm.close()
        with httpx.Client(timeout=60) as client:
            before = inband.push_before(client, url, tensors)
        assert engine.updates == []  # all refused (unknown names): nothing loaded
    for r in (after, staged, before):
        assert r["status"] == 422 and r["whole_body_read"], r
    row = {"size_mib": 1, "raw_copy": {"GBps": 1.0}, "shm": {"GBps": 0.8}, "after": {"GBps": 0.5},
           "before": {"skipped": "x"}}
    inband.plot({"results": [row], "skipped": [{"variant": "before", "size_mib": 1}], "before_predicted_cap_s": 60,
                 "machine": {"cpu_cores": 2, "torch": "t"}}, tmp_path / "inband.png")
    assert (tmp_path / "inband.png").stat().st_size > 0
