"""A bad weight update never reaches serving, on every CPU-runnable transport and engine.

Injected, per case: an unknown tensor name, a wrong shape, int32 for a float32 weight, bfloat16 for a float32 weight
(refused unless the server casts: ``--allow-dtype-cast``), NaN, inf, a truncated body. Transports: in-band (the
FastAPI app in process, ``hf`` and ``scripted`` engines) and NCCL through the torch communicator over gloo (real
``python -m trainer serve`` subprocesses, ``sync.nccl_backend: torch``). Each refusal must answer 4xx (422 for
content) naming the tensor, the learner transport's per-server error (``WeightTransportError: ...``) must carry
that text, and the old weights keep serving: ``/rm/weights_checksum/`` unchanged and ``/infer/`` answers identically.

Learner side: non-finite parameters stop ``WeightSync.ensure_fresh`` before anything is pushed, and a training run
stops with the parameter, the optimizer step and the last good checkpoint named (no checkpoint of the bad weights).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import httpx
import pytest
import torch
from safetensors.torch import save

from trainer.rollout.server_client import ServerEndpoint
from trainer.sync.transports import InbandTransport, NcclTransport, WeightTransportError
from trainer.sync.weights import tensor_checksum

INBAND = "/rm/update_weights_inband/"
GOOD = "model.norm.weight"  # sent beside the bad tensor: it must not be applied either
BAD = "model.layers.0.mlp.down_proj.weight"


def infer_body() -> dict:
    reqs = [{"messages": [{"role": "user", "content": f"Detect every object.\nScene: item {i}"}], "images": [],
             "uuid": f"s{i}"} for i in range(2)]
    return {"infer_requests": reqs, "request_config": {"max_tokens": 6, "temperature": 0.0}}


@dataclass
class Case:
    name: str
    tensors: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]  # served float32 state → the update
    tensor: str | None  # the tensor the refusal must name
    reason: str  # a fragment of the reason


def _with(state, name, value):
    return {GOOD: state[GOOD] + 0.5, name: value}


def _nan(state):
    t = state[BAD].clone()
    t[1, 2] = float("nan")
    return _with(state, BAD, t)


def _inf(state):
    t = state[BAD].clone()
    t[0, 0] = float("-inf")
    return _with(state, BAD, t)


CASES = [
    Case("unknown name", lambda s: {GOOD: s[GOOD] + 0.5, "model.layers.0.mlp.nope.weight": torch.zeros(2, 2)},
         "model.layers.0.mlp.nope.weight", "not a weight of the served model"),
    Case("wrong shape", lambda s: _with(s, BAD, torch.zeros(s[BAD].shape[0] + 1, s[BAD].shape[1])), BAD, "shape"),
    Case("int32 dtype", lambda s: _with(s, BAD, torch.ones(s[BAD].shape, dtype=torch.int32)), BAD,
         "not a floating dtype"),
    Case("bf16 for fp32", lambda s: _with(s, BAD, (s[BAD] + 1).to(torch.bfloat16)), BAD,
         "torch.bfloat16 != served torch.float32"),
    Case("NaN", _nan, BAD, "1 NaN"),
    Case("inf", _inf, BAD, "1 inf"),
]
BF16 = next(c for c in CASES if c.name == "bf16 for fp32")


def served(http: httpx.Client, url: str) -> tuple[dict[str, str], list, object]:
    """What is serving: per-tensor checksums, the answers to a fixed /infer/, the weights version."""
    sums = http.get(url + "/rm/weights_checksum/")
    assert sums.status_code == 200, sums.text
    answers = http.post(url + "/infer/", json=infer_body())
    assert answers.status_code == 200, answers.text
    info = http.get(url + "/rm/info/").json()
    return sums.json()["checksums"], [a["response"]["choices"][0]["token_ids"] for a in answers.json()], \
        info["weights_version"]


def assert_refused(resp: httpx.Response, case: Case) -> None:
    assert resp.status_code == 422, f"{case.name}: {resp.status_code} {resp.text}"
    body = resp.json()
    assert body["tensor"] == case.tensor and case.reason in body["reason"], f"{case.name}: {body}"
    assert body["detail"].startswith("weight update refused: ") and repr(case.tensor) in body["detail"]
    assert "the old weights keep serving" in body["detail"]


# --- in-band, in-process app --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_url(tiny_text_dir, serve):
    from trainer.server.app import create_app
    from trainer.server.hf_engine import HFServerEngine

    engine = HFServerEngine(tiny_text_dir)
    with serve(create_app(engine)) as url:
        yield url, engine


@pytest.fixture(scope="module")
def scripted_url(tiny_text_dir, serve):
    from trainer.server.app import create_app
    from trainer.server.scripted import ScriptedEngine

    engine = ScriptedEngine(tiny_text_dir)  # spec from the checkpoint's safetensors headers
    with serve(create_app(engine)) as url:
        yield url, engine


def _state(engine) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    if hasattr(engine, "model"):
        return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    return AutoModelForCausalLM.from_pretrained(engine.model_name).state_dict()


@pytest.mark.parametrize("engine_kind", ["hf", "scripted"])
def test_inband_bad_updates_are_refused_and_the_old_weights_keep_serving(engine_kind, request, http):
    url, engine = request.getfixturevalue(f"{engine_kind}_url")
    state = _state(engine)
    before = served(http, url)
    transport = InbandTransport(timeout_s=30)
    for case in CASES:
        resp = http.post(url + INBAND, params={"kind": "full"}, content=save(case.tensors(state)))
        assert_refused(resp, case)
        assert served(http, url) == before, f"{case.name}: the served weights changed"
        # the learner's transport reports the server's refusal text
        failed = transport.push_full(case.tensors(state), [ServerEndpoint(url)])
        msg = failed[url]
        assert msg.startswith(WeightTransportError.__name__), msg
        assert "refused (HTTP 422)" in msg and repr(case.tensor) in msg and case.reason in msg, msg
        assert served(http, url) == before
    # a truncated body: refused as malformed (400), nothing changes
    blob = save(_with(state, BAD, state[BAD] + 1))
    for cut in (len(blob) // 2, len(blob) - 3, 7):
        resp = http.post(url + INBAND, params={"kind": "full"}, content=blob[:cut])
        assert resp.status_code == 400 and "not a safetensors payload" in resp.json()["detail"], resp.text
    assert served(http, url) == before
    assert http.get(url + "/health/").status_code == 200
    transport.close()


@pytest.mark.parametrize("engine_kind", ["hf", "scripted"])
def test_inband_other_floating_dtype_is_cast_only_when_allowed(engine_kind, request, http):
    url, engine = request.getfixturevalue(f"{engine_kind}_url")
    state = _state(engine)
    update = BF16.tensors(state)
    assert_refused(http.post(url + INBAND, params={"kind": "full"}, content=save(update)), BF16)
    engine.allow_dtype_cast = True
    try:
        before = served(http, url)
        resp = http.post(url + INBAND, params={"kind": "full"}, content=save(update))
        assert resp.status_code == 200, resp.text
        sums = served(http, url)[0]
        if engine_kind == "hf":  # served in float32: the cast values arrived
            assert sums[BAD] == tensor_checksum(update[BAD].float()) and sums[GOOD] == tensor_checksum(update[GOOD])
            assert sums != before[0]
        else:
            assert sums[BAD] == tensor_checksum(update[BAD])
        # a good update afterwards restores the original weights (the module's other tests start from them)
        restore = {GOOD: state[GOOD], BAD: state[BAD]}
        assert http.post(url + INBAND, params={"kind": "full"}, content=save(restore)).status_code == 200
    finally:
        engine.allow_dtype_cast = False
    if engine_kind == "hf":
        assert served(http, url)[0] == before[0]


def test_a_refusal_in_a_background_receive_answers_422_on_the_next_waiting_call(serve, http):
    """An engine that refuses inside the background NCCL receive: the next waiting call answers 422 naming the
    tensor (not 500), once; the server stays healthy."""
    from trainer.server.app import create_app
    from trainer.server.scripted import ScriptedEngine
    from trainer.sync.update_check import WeightUpdateRefused

    class RefusesInReceive(ScriptedEngine):
        def nccl_receive_named(self, name, dtype, shape):
            raise WeightUpdateRefused(name, "holds non-finite values (1 NaN, 0 inf of 4 values)")

    engine = RefusesInReceive()
    with serve(create_app(engine)) as url:
        before = served(http, url)
        ok = http.post(url + "/update_named_param/", json={"name": "w", "dtype": "torch.float32", "shape": [4]})
        assert ok.status_code == 200
        resp = http.post(url + "/process_weights_after_loading/")
        assert resp.status_code == 422, resp.text
        body = resp.json()
        assert body["tensor"] == "w" and "background" in body["reason"] and "the old weights keep serving" in body["detail"]
        assert http.post(url + "/process_weights_after_loading/").status_code == 200, "reported once"
        assert served(http, url) == before and http.get(url + "/health/").status_code == 200


# --- NCCL transport: torch communicator over gloo, real server processes ------------------------------------------

def _nccl(url: str, get_free_port) -> NcclTransport:
    return NcclTransport([ServerEndpoint(url)], group_port=get_free_port(), timeout_s=60,
                         bucket_bytes=64 * 2**10, backend="torch")


@pytest.mark.parametrize("engine_kind", ["hf", "scripted"])
def test_nccl_bad_updates_are_staged_checked_and_refused(engine_kind, tiny_text_dir, get_free_port, http, trainer_serve):
    """hf: default server (no cast); scripted: started with ``--allow-dtype-cast`` (the bf16 case is accepted)."""
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(tiny_text_dir).state_dict()
    extra = ("--allow-dtype-cast",) if engine_kind == "scripted" else ()
    with trainer_serve(get_free_port(), "--engine", engine_kind, "--model", str(tiny_text_dir), *extra) as (url, _):
        before = served(http, url)
        for case in CASES:
            transport = _nccl(url, get_free_port)
            update = case.tensors(state)
            if case is BF16 and engine_kind == "scripted":
                assert transport.push_full(update, [ServerEndpoint(url)]) == {}  # cast allowed: accepted
                sums = served(http, url)[0]
                assert sums[BAD] == tensor_checksum(update[BAD]) and sums[GOOD] == tensor_checksum(update[GOOD])
                assert transport.push_full({GOOD: state[GOOD], BAD: state[BAD]}, [ServerEndpoint(url)]) == {}
                before = served(http, url)
                transport.close()
                continue
            failed = transport.push_full(update, [ServerEndpoint(url)])
            assert list(failed) == [url], f"{case.name}: {failed}"
            msg = failed[url]
            assert ("/process_weights_after_loading/" in msg and "refused (HTTP 422)" in msg
                    and repr(case.tensor) in msg and case.reason in msg), f"{case.name}: {msg}"
            assert served(http, url) == before, f"{case.name}: the served weights changed"
            transport.close()
        # a truncated bucket (metadata inconsistent with its byte count): refused at once, before any receive
        bad_meta = {"name": BAD, "shape": list(state[BAD].shape), "dtype": "torch.float32", "start_idx": 0,
                    "end_idx": 16, "numel": 16}
        resp = http.post(url + "/update_flattened_params/", json={"metadatas": [bad_meta]})
        assert resp.status_code == 422, resp.text
        assert http.post(url + "/process_weights_after_loading/").status_code == 200
        assert served(http, url) == before
        # and a good update over NCCL still lands after all these refusals
        transport = _nccl(url, get_free_port)
        good = {GOOD: state[GOOD] + 1.0}
        assert transport.push_full(good, [ServerEndpoint(url)]) == {}
        assert served(http, url)[0][GOOD] == tensor_checksum(good[GOOD])
        transport.close()
        timed = nccl_syncs_timed(http, url)
        assert timed["count"] == (3 if engine_kind == "scripted" else 1), "accepted NCCL syncs only, each once"
        assert timed["sum"] > 0


def nccl_syncs_timed(http, url) -> dict[str, float]:
    """``rm_server_weight_sync_seconds{transport="nccl"}``'s count and sum from the server's ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(http.get(url + "/metrics").text):
        for s in fam.samples:
            if s.name.startswith("rm_server_weight_sync_seconds_") and s.labels.get("transport") == "nccl":
                out[s.name.rsplit("_", 1)[1]] = s.value
    return out


def test_nccl_adapter_refused_in_the_background_is_reported_on_the_next_call(tiny_text_dir, get_free_port, http,
                                                                              trainer_serve):
    """Adapter buckets are loaded inside the background receive: a NaN adapter is refused there and the learner
    sees the 422 on its next call (``/reset_prefix_cache/``); the served version stays."""
    from trainer.sync.weights import AdapterWeights

    with trainer_serve(get_free_port(), "--engine", "scripted", "--model", str(tiny_text_dir)) as (url, _):
        before = served(http, url)
        transport = _nccl(url, get_free_port)
        bad = AdapterWeights({"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]},
                             {"base_model.model.q.lora_A.weight": torch.tensor([[1.0, float("nan")], [0.0, 1.0]])})
        msg = transport.push_adapter(bad, [ServerEndpoint(url)])[url]
        assert "/reset_prefix_cache/" in msg and "refused (HTTP 422)" in msg, msg
        assert "'base_model.model.q.lora_A.weight'" in msg and "background" in msg
        assert served(http, url) == before
        transport.close()


# --- learner side -------------------------------------------------------------------------------------------------

def test_learner_with_a_nan_parameter_pushes_nothing(scripted_server, http):
    from trainer.modeling.fixtures import build_tiny_model
    from trainer.rollout.server_client import ServerRolloutEngine
    from trainer.sync.policy import WeightSync
    from trainer.sync.update_check import NonFiniteWeightsError

    model, _ = build_tiny_model("text", seed=1)
    with scripted_server() as (url, engine):
        rollout = ServerRolloutEngine([ServerEndpoint(url)], timeout_s=10, transport="inband")
        sync = WeightSync.for_model(rollout, model, "full")
        assert sync.ensure_fresh(model, 0)
        pushed = list(engine.updates)
        assert len(pushed) == 1
        name = "model.layers.1.self_attn.k_proj.weight"
        with torch.no_grad():
            model.get_parameter(name)[0, 0] = float("nan")
        with pytest.raises(NonFiniteWeightsError) as info:
            sync.ensure_fresh(model, 3)
        err = info.value
        assert (err.tensor, err.step) == (name, 3)
        assert f"{name!r}" in str(err) and "optimizer step 3" in str(err)
        assert "rollout servers keep the last good weights (synced at step 0)" in str(err)
        assert engine.updates == pushed, "nothing was pushed"
        assert sync.last_step == 0 and sync.history == [(0, "full")]
        rollout.close()


@pytest.mark.parametrize("where", ["ensure_fresh", "checkpoint"])
def test_training_stops_on_non_finite_weights_and_keeps_the_last_good_checkpoint(where, serve, tmp_path, monkeypatch):
    """Real stage-2 training against a scripted server; after optimizer step ``k`` a parameter turns NaN.
    ``ensure_fresh``: checkpoints every 2 steps, NaN after step 3 → the sync before step 4's rollouts stops the run,
    checkpoint-2 is the last good one. ``checkpoint``: checkpoints every 2 steps, NaN during step 2 → checkpoint-2
    is refused (not written), no checkpoint exists. Either way the server never received the NaN weights."""
    from trainer.config.schema import validate_config
    from trainer.data.synthetic import generate
    from trainer.modeling.fixtures import save_tiny_model
    from trainer.server.app import create_app
    from trainer.server.scripted import ScriptedEngine
    from trainer.sft.run import run_training
    from trainer.sft.trainer import RolloutMatchingTrainer
    from trainer.sync.update_check import NonFiniteWeightsError

    model_dir = save_tiny_model(tmp_path / "vl", "vl", seed=0)
    generate(tmp_path / "data", 12, seed=0, min_objects=1, max_objects=2)
    poison_at = 2 if where == "ensure_fresh" else 1  # global_step during whose training step the NaN appears
    name = "model.language_model.layers.0.mlp.up_proj.weight"
    original = RolloutMatchingTrainer.training_step

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = original(self, model, inputs, num_items_in_batch)
        if self.state.global_step == poison_at:
            with torch.no_grad():
                self.accelerator.unwrap_model(self.model).get_parameter(name).fill_(float("nan"))
        return loss

    monkeypatch.setattr(RolloutMatchingTrainer, "training_step", training_step)
    engine = ScriptedEngine(model_dir)
    with serve(create_app(engine)) as url:
        cfg = validate_config({
            "model": {"tiny": "vl", "tiny_seed": 0},
            "data": {"train_jsonl": str(tmp_path / "data" / "train.jsonl")},
            "training": {"output_dir": str(tmp_path / "run"), "max_steps": 4, "per_device_train_batch_size": 3,
                         "learning_rate": 1e-3, "logging_steps": 1, "seed": 0, "disable_tqdm": True,
                         "report_to": ["jsonl"], "save_steps": 2},
            "custom": {"extra": {"rollout_matching": {
                "rollout_backend": "vllm", "rollout_generate_batch_size": 3, "decoding": {"max_new_tokens": 16},
                "vllm": {"mode": "server", "server": {"servers": [{"base_url": url}], "timeout_s": 30},
                         "sync": {"mode": "full", "transport": "inband"}}}}},
        })
        with pytest.raises(NonFiniteWeightsError) as info:
            run_training(cfg)
    err = info.value
    stage2 = tmp_path / "run" / "stage2"
    checkpoints = sorted(p.name for p in stage2.glob("checkpoint-*"))
    text = str(err)
    assert err.tensor.endswith("layers.0.mlp.up_proj.weight") and "rollout servers keep the last good weights" in text
    if where == "ensure_fresh":
        assert err.step == 3 and "optimizer step 3" in text
        assert checkpoints == ["checkpoint-2"] and f"the last checkpoint is {stage2 / 'checkpoint-2'}" in text
        assert "synced at step 2" in text
        synced = 3  # steps 0, 1, 2
    else:
        assert err.step == 2 and "optimizer step 2" in text
        assert checkpoints == [] and "none (no checkpoint was written before this step)" in text
        synced = 2  # steps 0, 1
    full = [u for u in engine.updates if u["kind"] == "full"]
    assert len(full) == synced, "every push happened before the NaN; none after"
    assert not (tmp_path / "run" / "final").exists()


def test_train_cli_reports_non_finite_weights_with_exit_code_3(monkeypatch, tmp_path, capsys):
    import argparse

    import trainer.sft.run as run_module
    from trainer.sft import cli
    from trainer.sync.update_check import NonFiniteWeightsError

    def boom(cfg, resume_from_checkpoint=None):
        raise NonFiniteWeightsError("model.w", 5, 4, "/out/stage2/checkpoint-4")

    monkeypatch.setattr(run_module, "run_training", boom)
    monkeypatch.setattr(cli, "load_or_report", lambda path, quiet=False: argparse.Namespace(training=argparse.Namespace()))
    monkeypatch.setattr(cli, "preflight_or_report", lambda cfg, quiet=False: True)
    rc = cli.run(argparse.Namespace(config="x.yaml", output_dir=None, max_steps=None, resume_from_checkpoint=None))
    assert rc == 3
    err = capsys.readouterr().err
    assert "'model.w'" in err and "optimizer step 5" in err and "checkpoint-4" in err
