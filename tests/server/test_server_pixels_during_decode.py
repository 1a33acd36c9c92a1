"""``vllm.pixels_during_decode`` with rollout servers (sync): the learner sends requests built from each image's size,
the servers make their own prompt ids from the image files, and the learner's image processor makes the training
pixels on its thread while the servers decode. Real stage-2 training over HTTP against an in-process scripted server
(``trainer.server.scripted``): the server's decode waits for the learner's pixel thread to start, so a run that made
the pixels before the decode would fail, and the losses equal those of the default order."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from trainer.config.schema import validate_config
from trainer.rollout.codec import RolloutCodec
from trainer.server.scripted import ScriptedEngine


class DecodesWhilePixelsAreMade(ScriptedEngine):
    """Before answering, waits (up to ``wait_s``) for the learner's pixel thread to have started; records whether it
    had, per generate call."""

    def __init__(self, *args, pixels_started: threading.Event, wait_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.pixels_started, self.wait_s = pixels_started, wait_s
        self.overlapped: list[bool] = []

    def generate(self, requests, params):
        self.overlapped.append(self.pixels_started.wait(self.wait_s))
        self.pixels_started.clear()
        return super().generate(requests, params)


def _config(tmp_path: Path, name: str, url: str, during: bool, async_rollouts: bool = False) -> dict:
    return {
        "model": {"tiny": "vl", "tiny_seed": 0},
        "data": {"train_jsonl": str(tmp_path / "data" / "train.jsonl")},
        "training": {"output_dir": str(tmp_path / name), "max_steps": 3, "per_device_train_batch_size": 2,
                     "learning_rate": 1e-3, "logging_steps": 1, "seed": 0, "disable_tqdm": True,
                     "report_to": ["jsonl"]},
        "custom": {"extra": {"rollout_matching": {
            "rollout_backend": "vllm", "rollout_generate_batch_size": 2, "decoding": {"max_new_tokens": 24},
            "vllm": {"mode": "server", "pixels_during_decode": during,
                     "server": {"servers": [{"base_url": url}], "timeout_s": 30,
                                "async_rollouts": {"enabled": async_rollouts}},
                     "sync": {"mode": "full", "transport": "inband"}}}}},
    }


def test_server_sync_accepts_it_and_async_refuses_it(tmp_path):
    url = "http://127.0.0.1:8000"
    assert validate_config(_config(tmp_path, "a", url, True)).rollout_matching.vllm.pixels_during_decode
    with pytest.raises(ValueError, match="pixels_during_decode and server.async_rollouts.enabled do not combine"):
        validate_config(_config(tmp_path, "b", url, True, async_rollouts=True))


def _train(tmp_path, serve, model_dir, name: str, during: bool, monkeypatch) -> tuple[list[float], list[bool]]:
    from trainer.server.app import create_app
    from trainer.sft.run import run_training

    started = threading.Event()
    original = RolloutCodec.with_pixels

    def with_pixels(self, samples, requests):
        started.set()
        return original(self, samples, requests)

    monkeypatch.setattr(RolloutCodec, "with_pixels", with_pixels)
    # off: nothing starts a pixel thread, so each decode waits its 0.3 s and records False
    engine = DecodesWhilePixelsAreMade(model_dir, pixels_started=started, wait_s=30.0 if during else 0.3)
    with serve(create_app(engine)) as url:
        summary = run_training(validate_config(_config(tmp_path, name, url, during)))
    monkeypatch.undo()
    rows = [json.loads(x) for x in Path(summary.metrics_path).read_text().splitlines()]
    losses = [r["loss"] for r in rows if r.get("phase") == "stage2" and "loss" in r]
    ledger = [json.loads(x) for x in (Path(summary.output_dir) / "stage2" / "ledger.jsonl").read_text().splitlines()]
    assert summary.stage2_steps == 3 and len(ledger) == 6, "every record of the three steps trained once"
    return losses, engine.overlapped


def test_training_over_http_is_the_same_with_the_pixels_made_during_the_decode(tmp_path, serve, monkeypatch):
    from trainer.data.synthetic import generate
    from trainer.modeling.fixtures import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "vl", "vl", seed=0)
    generate(tmp_path / "data", 6, seed=4, min_objects=1, max_objects=2, image_size=64)
    before, overlapped_before = _train(tmp_path, serve, model_dir, "before", False, monkeypatch)
    during, overlapped_during = _train(tmp_path, serve, model_dir, "during", True, monkeypatch)
    assert overlapped_before == [False] * 3, "without the option the pixels are made before the decode"
    assert overlapped_during == [True] * 3, "every decode ran while the learner's pixel thread was making pixels"
    assert len(during) == 3 and during == pytest.approx(before, rel=1e-6, abs=1e-7)
