"""The scripted stub answers ``/get_world_size/`` as the server it stands in for: tensor × data parallel, as
``swift rollout`` does (docs/reference/rollout-protocol.md; the summary-GRPO quickstart's DP-6 server answers 6).
Its NCCL receive is one rank, so a larger world refuses ``/init_communicator/`` at once, naming the in-band
transport; in-band updates work at any world size."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save

from trainer.cli import build_parser
from trainer.config.loader import resolve_yaml
from trainer.config.schema import validate_config
from trainer.launch.commands import ServerOptions, server_command
from trainer.server.app import create_app
from trainer.server.cli import build_engine
from trainer.server.scripted import ScriptedEngine

REPO = Path(__file__).resolve().parents[2]


def _serve_args(*flags: str):
    return build_parser("serve").parse_args(["serve", "--engine", "scripted", *flags])


@pytest.mark.parametrize("flags, world", [((), 1), (("--data-parallel-size", "6"), 6),
                                          (("--tensor-parallel-size", "2", "--data-parallel-size", "3"), 6)])
def test_get_world_size_is_tensor_times_data_parallel(flags, world):
    engine = build_engine(_serve_args(*flags))
    with TestClient(create_app(engine)) as client:
        assert client.get("/get_world_size/").json() == {"world_size": world}


def test_a_world_above_one_refuses_nccl_at_once_and_takes_inband_updates():
    engine = ScriptedEngine(world_size=6)
    with TestClient(create_app(engine), raise_server_exceptions=False) as client:
        refused = client.post("/init_communicator/", json={"host": "127.0.0.1", "port": 51216, "world_size": 7})
        assert 400 <= refused.status_code < 500 and "sync.transport: inband" in refused.text
        body = save({"w": torch.ones(2, 3)})
        taken = client.post("/rm/update_weights_inband/?kind=full", content=io.BytesIO(body).getvalue(),
                            headers={"content-type": "application/octet-stream"})
        assert taken.status_code == 200, taken.text
    assert engine.full_version != "initial", "the in-band update arrived"
    assert ScriptedEngine().nccl_refusal is None


def test_other_engines_refuse_data_parallelism():
    with pytest.raises(SystemExit, match="one engine per server"):
        build_engine(build_parser("serve").parse_args(["serve", "--engine", "hf", "--model", "/m",
                                                       "--data-parallel-size", "2"]))


def test_launch_server_passes_the_grpo_servers_world_to_the_stub():
    summary = validate_config(resolve_yaml(REPO / "configs" / "summary_1024.yaml"))
    argv = server_command(ServerOptions(engine="scripted"), summary).argv
    serve = build_parser("serve").parse_args(argv[argv.index("serve"):])
    assert build_engine(serve).world_size == 6, "summary_1024's swift rollout: TP 1 x DP 6"
    flagged = server_command(ServerOptions(engine="scripted", tensor_parallel_size=2, data_parallel_size=2)).argv
    assert flagged[flagged.index("--tensor-parallel-size"):] == ["--tensor-parallel-size", "2",
                                                                  "--data-parallel-size", "2"]
