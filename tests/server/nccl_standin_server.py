"""A scripted rollout server whose NCCL receiver is the CPU stand-in communicator (tests only; the real CLI has no
such switch): ``python nccl_standin_server.py PORT``. Weights pushed over the "nccl" transport travel through the
group's TCP store instead of NCCL, everything else (HTTP calls, group rendezvous, buckets) is the real path."""

from __future__ import annotations

import sys

import uvicorn

from trainer.server.app import create_app
from trainer.server.engines import LocalNcclReceiver
from trainer.server.scripted import ScriptedEngine
from trainer.sync.transports import StoreBroadcastCommunicator

if __name__ == "__main__":
    engine = ScriptedEngine()
    engine._receiver = LocalNcclReceiver(StoreBroadcastCommunicator)
    uvicorn.run(create_app(engine), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
