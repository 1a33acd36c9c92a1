"""Real vLLM on a CUDA GPU (bf16): the colocate engine with and without LoRA (full, adapter and auto sync), sleep
levels 1 and 2, ``serve --engine vllm`` with in-band sync and a refused bad update, and stage-2 training with the
vLLM colocate backend (text and Qwen3-VL, images through vLLM) and in server mode on one GPU.

Greedy equality with HF: vLLM's and HF's bf16 kernels (GEMM tilings, fused RMSNorm, paged attention) disagree by a
few bf16 ulps on the logits, so on a random tiny model, whose top logits are often nearly tied, exact token equality
is not a property either side promises. The test asks instead that every token vLLM chose is greedy under HF up to
``LOGIT_TOL``: teacher-forced on vLLM's sequence, HF's logit of vLLM's token is within ``LOGIT_TOL`` of HF's maximum.
After a weight sync the same check runs against the new weights (and must fail against the old ones), and the
served parameters are compared bit for bit with the learner's.

Run on the GPU machine: ``python -m pytest -m gpu tests/gpu/test_vllm_gpu.py`` (set ``RM_GPU_RESULTS=FILE`` to
collect the measured timings as JSON lines).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import torch

from tests.gpu.gpu_results import record
from trainer.launch.ports import listen_port as _free_port  # below the ephemeral range

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                                 reason="needs a CUDA GPU and vLLM (pip install 'rollout-matching[vllm]')")]

DT = torch.bfloat16
LOGIT_TOL = 0.125
EAGER = {"enforce_eager": True}


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    from trainer.modeling.fixtures import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "text", "text")


@pytest.fixture(scope="module")
def tok():
    from trainer.modeling.fixtures import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture(scope="module")
def stop_ids(tok):
    from trainer.modeling.coord_vocab import stop_token_ids

    return sorted(stop_token_ids(tok))


@pytest.fixture(scope="module")
def hf_model(text_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(text_dir, dtype=DT).cuda().eval()


def make_requests(tok, n=6):
    from trainer.rollout.types import RolloutRequest

    out = []
    for i in range(n):
        msgs = ({"role": "user", "content": f"Detect every object.\nScene: shape {i} of {n}"},)
        text = tok.apply_chat_template(list(msgs), tokenize=False, add_generation_prompt=True)
        out.append(RolloutRequest(f"g{i}", msgs, tuple(tok(text, add_special_tokens=False)["input_ids"])))
    return out


def params():
    from trainer.rollout.types import DecodingParams

    return DecodingParams(max_new_tokens=24)


@torch.no_grad()
def greedy_gaps(model, results) -> list[float]:
    """Per result: the largest (HF max logit - HF logit of the token vLLM chose) over its response."""
    gaps = []
    for r in results:
        ids = torch.tensor([list(r.prompt_token_ids) + list(r.response_token_ids)], device="cuda")
        logits = model(input_ids=ids).logits[0].float()
        start = len(r.prompt_token_ids) - 1
        steps = logits[start:start + len(r.response_token_ids)]
        chosen = steps.gather(1, torch.tensor(r.response_token_ids, device="cuda")[:, None])[:, 0]
        gaps.append(float((steps.max(dim=1).values - chosen).max()) if len(r.response_token_ids) else 0.0)
    return gaps


def assert_greedy(model, results, what: str) -> float:
    gaps = greedy_gaps(model, results)
    assert max(gaps) <= LOGIT_TOL, f"{what}: vLLM tokens not greedy under HF (logit gaps {gaps})"
    return max(gaps)


def perturbed(model, seed=7, scale=0.2):
    learner = copy.deepcopy(model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(torch.randn_like(p) * scale)
    return learner


def _served(worker, names):
    from trainer.rollout import vllm_compat

    params = {k.replace(".base_layer", ""): v for k, v in vllm_compat.worker_model(worker).named_parameters()}
    return {n: params[n].detach().to("cpu").clone() for n in names}


def assert_weights_bit_exact(engine, weights, what: str = "the learner's") -> None:
    """The served parameters equal ``weights`` (HF names to tensors: a model's ``state_dict()`` or ``full_weights``
    of a LoRA learner), dtype and bits, with qkv stacked as vLLM stores it."""
    sd = {k: v.detach().cpu() for k, v in weights.items()}
    want = {
        "model.embed_tokens.weight": sd["model.embed_tokens.weight"],
        "model.norm.weight": sd["model.norm.weight"],
        "model.layers.1.mlp.down_proj.weight": sd["model.layers.1.mlp.down_proj.weight"],
        "model.layers.0.self_attn.qkv_proj.weight": torch.cat([sd[f"model.layers.0.self_attn.{x}_proj.weight"]
                                                               for x in "qkv"]),
    }
    got = engine.vllm.collective_rpc(_served, list(want))[0]
    for name, w in want.items():
        g = got[name][: w.shape[0]]
        assert g.dtype == w.dtype and torch.equal(g, w), f"{name}: served weights differ from {what}"


def colocate(text_dir, stop_ids, **kw):
    from trainer.rollout.vllm_colocate import VllmColocateEngine

    t0 = time.perf_counter()
    eng = VllmColocateEngine(text_dir, stop_ids, max_model_len=512, gpu_memory_utilization=kw.pop("util", 0.12),
                             dtype="bfloat16", engine_kwargs=EAGER, **kw)
    return eng, time.perf_counter() - t0


@pytest.mark.parametrize("lora", [False, True], ids=["no-lora", "lora-enabled"])
def test_colocate_full_sync_in_process(text_dir, tok, stop_ids, hf_model, lora):
    from trainer.rollout.types import check_prompt_alignment

    engine, start_s = colocate(text_dir, stop_ids, enable_lora=lora, max_lora_rank=8)
    try:
        reqs = make_requests(tok)
        before = engine.generate(reqs, params())
        check_prompt_alignment(reqs, before)
        gap0 = assert_greedy(hf_model, before, "base weights")
        learner = perturbed(hf_model)
        engine.sync_full(learner)
        sync = dict(engine.timings)
        after = engine.generate(reqs, params())
        gap1 = assert_greedy(learner, after, "after full sync")
        assert max(greedy_gaps(hf_model, after)) > LOGIT_TOL or [r.response_token_ids for r in after] != \
            [r.response_token_ids for r in before], "the sync did not change what vLLM decodes"
        assert_weights_bit_exact(engine, learner.state_dict())
        engine.sync_full(hf_model)
        assert [r.response_token_ids for r in engine.generate(reqs, params())] == \
            [r.response_token_ids for r in before]
        record(f"colocate_full_sync[{'lora' if lora else 'plain'}]", start_s=start_s, max_gap_base=gap0,
               max_gap_synced=gap1, **sync)
    finally:
        engine.close()


def test_colocate_adapter_and_auto_policy(text_dir, tok, stop_ids, hf_model):
    from peft import LoraConfig, get_peft_model

    from trainer.sync.policy import WeightSync

    engine, _ = colocate(text_dir, stop_ids, enable_lora=True, max_lora_rank=8)
    try:
        reqs = make_requests(tok)
        base = engine.generate(reqs, params())
        peft_model = get_peft_model(copy.deepcopy(hf_model), LoraConfig(
            r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False))
        sync = WeightSync.for_model(engine, peft_model, "auto")
        assert sync.decision.mode == "adapter"
        assert sync.ensure_fresh(peft_model, 0)
        out0 = engine.generate(reqs, params())
        assert_greedy(peft_model, out0, "adapter step 0")
        assert max(greedy_gaps(hf_model, out0)) > LOGIT_TOL or \
            [r.response_token_ids for r in out0] != [r.response_token_ids for r in base]
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.mul_(-2.0)
        assert not sync.ensure_fresh(peft_model, 0)
        assert sync.ensure_fresh(peft_model, 1)
        assert_greedy(peft_model, engine.generate(reqs, params()), "adapter step 1")
        assert sync.history == [(0, "base+adapter"), (1, "adapter")]
        full = WeightSync.for_model(engine, peft_model, "full")
        full.ensure_fresh(peft_model, 2)
        merged = engine.generate(reqs, params())
        assert engine.vllm.lora_request is None
        assert_greedy(peft_model, merged, "LoRA merged into a LoRA-enabled engine")
    finally:
        engine.close()


def _buffer_sums(worker) -> dict[str, float]:
    return {n: float(b.double().sum()) for n, b in worker.model_runner.model.named_buffers()}


def sleep_check(level: int | str) -> dict:
    """One sleep level in this process: memory released, outputs after wake equal outputs before, timings.
    ``kv_cache``: the weights stay mapped through the sleep (nothing of theirs sleeps, no wake in the sync)."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from trainer.modeling.coord_vocab import stop_token_ids
    from trainer.modeling.fixtures import save_tiny_model, tiny_tokenizer

    text_dir = save_tiny_model(Path(tempfile.mkdtemp()) / "text", "text")
    tok = tiny_tokenizer()
    hf_model = AutoModelForCausalLM.from_pretrained(text_dir, dtype=DT).cuda().eval()
    engine, _ = colocate(text_dir, sorted(stop_token_ids(tok)), sleep_level=level, util=0.3, prewake=True)
    try:
        reqs = make_requests(tok)
        engine.sync_full(hf_model)
        before = [r.response_token_ids for r in engine.generate(reqs, params())]
        assert engine.vllm.asleep
        engine.vllm.wake()
        torch.cuda.synchronize()
        buffers = engine.vllm.collective_rpc(_buffer_sums)[0]
        free_awake = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        engine.vllm.sleep()
        torch.cuda.synchronize()
        sleep_s = time.perf_counter() - t0
        freed = torch.cuda.mem_get_info()[0] - free_awake
        assert freed > 0.5 * 0.3 * torch.cuda.get_device_properties(0).total_memory, freed
        if level == "kv_cache":
            from trainer.rollout.vllm_compat import sleeping_bytes

            assert engine.vllm._asleep == {"kv_cache"} and sleeping_bytes(["weights"]) == 0
            assert sleeping_bytes(["kv_cache"]) > 0.5 * freed
        from trainer.rollout.vllm_compat import inner_worker

        left = engine.vllm.collective_rpc(lambda w: len(getattr(inner_worker(w), "_sleep_saved_buffers", {})))[0]
        assert left == 0 or level != 2, f"vLLM's worker still restores {left} buffers with pageable copies"
        t0 = time.perf_counter()
        engine.begin_sync()  # level 2: the weights start waking on a thread (sync.prewake, off by default)
        assert engine.vllm._waking is not None or level != 2
        engine.sync_full(hf_model)
        engine.end_sync()
        sync_s = time.perf_counter() - t0
        assert engine.vllm.collective_rpc(_buffer_sums)[0] == buffers, "model buffers after the wake differ"
        pinned = engine.vllm.collective_rpc(lambda w: getattr(inner_worker(w), "_rm_pinned_block", None) is not None)[0]
        assert pinned == (level == 2), "level 2 keeps vLLM's saved buffers page-locked"
        t0 = time.perf_counter()
        engine.vllm.wake()
        torch.cuda.synchronize()
        wake_s = time.perf_counter() - t0
        after = [r.response_token_ids for r in engine.generate(reqs, params())]
        assert after == before, "outputs after sleep/wake differ from before"
        if level == 2:  # weights discarded: a generate without a sync reloads them from the learner
            engine.vllm.sleep()
            assert [r.response_token_ids for r in engine.generate(reqs, params())] == before
        return {"freed_gib": freed / 2**30, "sleep_s": sleep_s, "wake_s": wake_s, "sync_s": sync_s,
                "per_step_overhead_s": sleep_s + wake_s + sync_s}
    finally:
        engine.close()


def recorded_load_check() -> dict:
    """``vllm.sync.recorded_load`` at sleep level 2: the first sync records vLLM's loader, later ones (across a sleep
    and wake, which keeps the parameters' addresses) replay it; the served weights are the learner's bit for bit and
    decode greedily under it, and vLLM's own loader on the same update leaves every parameter equal to the replay.
    Load seconds of each path."""
    import tempfile
    from dataclasses import replace

    from transformers import AutoModelForCausalLM

    from trainer.modeling.coord_vocab import stop_token_ids
    from trainer.modeling.fixtures import save_tiny_model, tiny_tokenizer
    from trainer.rollout.vllm_compat import inner_worker, worker_model

    text_dir = save_tiny_model(Path(tempfile.mkdtemp()) / "text", "text")
    tok = tiny_tokenizer()
    hf_model = AutoModelForCausalLM.from_pretrained(text_dir, dtype=DT).cuda().eval()
    engine, _ = colocate(text_dir, sorted(stop_token_ids(tok)), sleep_level=2, util=0.3, recorded_load=True)

    def state():
        worker = engine.vllm.llm.collective_rpc(lambda w: inner_worker(w))[0]
        return worker._rm_load_path, {n: p.detach().clone() for n, p in worker_model(worker).named_parameters()}

    try:
        reqs = make_requests(tok)
        paths, loads = [], []
        for seed in (1, 2, 3):
            learner = perturbed(hf_model, seed=seed, scale=0.05)
            engine.sync_full(learner)
            path, replayed = state()  # read while the weights are mapped: the decode below puts them to sleep
            paths.append(path)
            loads.append(engine.vllm.last_load.load_s)
            assert_weights_bit_exact(engine, learner.state_dict())
            assert_greedy(learner, engine.generate(reqs, params()), f"replayed load, seed {seed}")
            assert engine.vllm.asleep
        assert paths == ["recorded", "replayed", "replayed"], paths
        engine.vllm.settings = replace(engine.vllm.settings, recorded_load=False)
        engine.sync_full(perturbed(hf_model, seed=4, scale=0.05))
        engine.sync_full(learner)
        path, loaded = state()
        assert path == "loader"
        assert all(torch.equal(v, replayed[n]) for n, v in loaded.items()), "replay differs from vLLM's loader"
        return {"load_s": loads, "loader_load_s": engine.vllm.last_load.load_s}
    finally:
        engine.close()


def overlap_wake_check() -> dict:
    """``vllm.sync.overlap_wake`` at sleep level 2 with a LoRA learner (the merge queued on the GPU, the weights woken
    while it and the finite check run): the engine decodes greedily under the merged learner; a learner with a NaN
    is refused after the wake with nothing written, the engine keeps no valid weights, and the next good sync serves
    again. The sync seconds of each good sync."""
    import tempfile

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trainer.modeling.coord_vocab import stop_token_ids
    from trainer.modeling.fixtures import save_tiny_model, tiny_tokenizer
    from trainer.sync.update_check import WeightUpdateRefused

    text_dir = save_tiny_model(Path(tempfile.mkdtemp()) / "text", "text")
    tok = tiny_tokenizer()
    base = AutoModelForCausalLM.from_pretrained(text_dir, dtype=DT).cuda().eval()
    learner = get_peft_model(perturbed(base), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in learner.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    engine, _ = colocate(text_dir, sorted(stop_token_ids(tok)), sleep_level=2, util=0.3, overlap_wake=True)
    try:
        reqs = make_requests(tok)
        syncs = []
        t0 = time.perf_counter()
        engine.sync_full(learner)
        syncs.append(time.perf_counter() - t0)
        first = engine.generate(reqs, params())
        assert_greedy(learner, first, "overlap_wake: LoRA merged at level 2")
        assert engine.vllm.asleep
        poisoned = copy.deepcopy(learner)
        with torch.no_grad():
            next(p for n, p in poisoned.named_parameters() if "lora_B" in n).fill_(float("nan"))
        with pytest.raises(WeightUpdateRefused, match="non-finite"):
            engine.sync_full(poisoned)
        assert "weights" not in engine.vllm._asleep, "overlap_wake woke the weights before reading the check"
        assert not engine.vllm._weights_valid, "a refused update leaves level 2 without valid weights"
        with torch.no_grad():
            for name, p in learner.named_parameters():
                if "lora_B" in name:
                    p.mul_(-1.5)
        t0 = time.perf_counter()
        engine.sync_full(learner)
        syncs.append(time.perf_counter() - t0)
        second = engine.generate(reqs, params())
        assert_greedy(learner, second, "overlap_wake: after a refused update")
        assert [r.response_token_ids for r in second] != [r.response_token_ids for r in first] or \
            max(greedy_gaps(base, second)) > LOGIT_TOL
        return {"sync_s": syncs, "timings": dict(engine.timings)}
    finally:
        engine.close()


def merge_into_engine_check() -> dict:
    """``vllm.sync.merge_into_engine`` at sleep level 2 with a LoRA learner: the first sync records vLLM's loader
    (merged on the learner's side), later ones write each layer's merge GEMM into the woken engine's parameters; the
    served weights equal ``full_weights`` of the learner bit for bit and decode greedily under it; a learner with a
    NaN is refused after the write, naming the engine's state, and the next good sync serves again. Sync and load
    seconds of each good sync, and the load path each took."""
    import tempfile

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trainer.modeling.coord_vocab import stop_token_ids
    from trainer.modeling.fixtures import save_tiny_model, tiny_tokenizer
    from trainer.rollout.vllm_compat import inner_worker
    from trainer.sync.update_check import WeightUpdateRefused
    from trainer.sync.weights import full_weights

    text_dir = save_tiny_model(Path(tempfile.mkdtemp()) / "text", "text")
    tok = tiny_tokenizer()
    base = AutoModelForCausalLM.from_pretrained(text_dir, dtype=DT).cuda().eval()
    learner = get_peft_model(perturbed(base), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    engine, _ = colocate(text_dir, sorted(stop_token_ids(tok)), sleep_level=2, util=0.3, recorded_load=True,
                         merge_into_engine=True)

    def served_equals_merged() -> None:
        assert_weights_bit_exact(engine, full_weights(learner), "the merged learner's")

    def load_path() -> str:
        return engine.vllm.llm.collective_rpc(lambda w: inner_worker(w)._rm_load_path)[0]

    try:
        reqs = make_requests(tok)
        syncs, loads, paths = [], [], []
        for i in range(3):
            with torch.no_grad():
                for name, p in learner.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0.0, 0.05)
            t0 = time.perf_counter()
            engine.sync_full(learner)
            syncs.append(time.perf_counter() - t0)
            loads.append(engine.vllm.last_load.load_s)
            paths.append(load_path())
            served_equals_merged()
            assert_greedy(learner, engine.generate(reqs, params()), f"merge_into_engine, sync {i}")
            assert engine.vllm.asleep and not engine.vllm._weights_valid
        assert paths == ["recorded", "merged", "merged"], paths
        poisoned = copy.deepcopy(learner)
        with torch.no_grad():
            next(p for n, p in poisoned.named_parameters() if "lora_B" in n).fill_(float("nan"))
        with pytest.raises(WeightUpdateRefused, match="after the LoRA merge into it; the engine holds no valid"):
            engine.sync_full(poisoned)
        assert not engine.vllm._weights_valid
        engine.sync_full(learner)
        assert load_path() == "merged"
        served_equals_merged()
        assert_greedy(learner, engine.generate(reqs, params()), "merge_into_engine: after a refused update")
        return {"sync_s": syncs, "load_s": loads, "paths": paths}
    finally:
        engine.close()


def test_merge_into_engine_serves_the_merged_learner_bit_for_bit_and_refuses_a_nan_after_the_write():
    """In a fresh process (a sleep-mode engine, ``in_fresh_process``)."""
    record("merge_into_engine", **in_fresh_process("merge_into_engine"))


def test_overlap_wake_serves_the_merged_learner_and_refuses_a_nan_after_the_wake():
    """In a fresh process (a sleep-mode engine, ``in_fresh_process``)."""
    record("overlap_wake", **in_fresh_process("overlap_wake"))


def test_recorded_load_replays_vllm_s_loader():
    """In a fresh process (a sleep-mode engine, ``in_fresh_process``)."""
    record("recorded_load", **in_fresh_process("recorded_load"))


def in_fresh_process(check: str, *args: str, timeout: float = 300) -> dict:
    """Run ``check`` (a name in ``CHECKS``) with ``args`` in a new Python process; its result dict. A sleep-mode
    engine needs a process of its own: vLLM's sleep-mode allocator (CuMemAllocator) is one per process, a second
    sleep-mode engine in one process fails ("CuMem allocator can only be used for one instance per process", or a
    tiny allocation failing with the GPU free; seen with vLLM 0.26), and ``InProcessVllm`` refuses to start one."""
    proc = subprocess.run([sys.executable, __file__, check, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "VLLM_PLUGINS": ""})
    line = next((x for x in proc.stdout.splitlines() if x.startswith("CHECK_RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(line.removeprefix("CHECK_RESULT "))


@pytest.mark.parametrize("level", [1, 2, "kv_cache"])
def test_sleep_levels_release_memory_and_wake_identical(level):
    """Each level in a fresh process (``in_fresh_process``)."""
    record(f"sleep_level_{level}", **in_fresh_process("sleep", str(level)))




def _serve(model_dir, log: Path, util=0.12, extra=()):
    port = _free_port()
    cmd = [sys.executable, "-m", "trainer", "serve", "--engine", "vllm", "--model", str(model_dir), "--port", str(port),
           "--max-model-len", "1024", "--gpu-memory-utilization", str(util), "--enforce-eager", "--dtype", "bfloat16",
           *extra]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "VLLM_PLUGINS": ""})
    return f"http://127.0.0.1:{port}", proc


def _stop(proc):
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_serve_vllm_inband_sync_and_refused_bad_update(text_dir, tok, stop_ids, hf_model, tmp_path):
    from trainer.rollout.server_client import ServerEndpoint, ServerRolloutEngine
    from trainer.sync.weights import full_weights, safetensors_bytes

    url, proc = _serve(text_dir, tmp_path / "serve.log")
    try:
        try:
            client = ServerRolloutEngine([ServerEndpoint(url)], timeout_s=300, transport="inband")
        except Exception:
            print((tmp_path / "serve.log").read_text()[-4000:])
            raise
        reqs = make_requests(tok)
        base = client.generate(reqs, params())
        assert_greedy(hf_model, base, "served base weights")
        learner = perturbed(hf_model)
        t0 = time.perf_counter()
        client.sync_full(learner)
        sync_s = time.perf_counter() - t0
        synced = client.generate(reqs, params())
        assert_greedy(learner, synced, "served after in-band sync")
        assert not client.quarantined
        bad = full_weights(learner)
        bad["model.layers.0.mlp.up_proj.weight"] = torch.full_like(bad["model.layers.0.mlp.up_proj.weight"], float("nan"))
        resp = httpx.post(url + "/rm/update_weights_inband/", params={"kind": "full"}, content=bytes(safetensors_bytes(bad)),
                          timeout=120)
        assert resp.status_code == 422, resp.text
        assert "model.layers.0.mlp.up_proj.weight" in resp.text
        again = client.generate(reqs, params())
        assert [r.response_token_ids for r in again] == [r.response_token_ids for r in synced]
        nbytes = sum(t.numel() * t.element_size() for t in full_weights(learner).values())
        phases = [u for u in httpx.get(url + "/rm/info/", timeout=30).json()["updates"]
                  if u["endpoint"] == "rm/update_weights_inband"]
        assert phases and all(k in phases[0] for k in ("read_s", "decode_s", "load_s")), phases
        record("serve_inband_sync", seconds=sync_s, bytes=nbytes, refused_status=resp.status_code,
               client=client.transport().last_push, server=phases[0])
        client.close()
    finally:
        _stop(proc)


def test_serve_vllm_shm_sync_and_refused_bad_update(text_dir, tok, stop_ids, hf_model, tmp_path):
    """In-band updates through a shared directory (``--shm-dir`` / ``sync.shm_dir``) into the vLLM server engine:
    two pushes through the one staging file serve the learner's weights, a NaN update is refused with the last
    good weights serving, and the server's phases are recorded."""
    from trainer.rollout.server_client import ServerEndpoint, ServerRolloutEngine
    from trainer.sync.transports import InbandTransport
    from trainer.sync.weights import full_weights

    shm_root = "/dev/shm" if Path("/dev/shm").is_dir() else None
    shm_dir = Path(tempfile.mkdtemp(prefix="rm-gpu-shm-", dir=shm_root))
    url, proc = _serve(text_dir, tmp_path / "serve.log", extra=("--shm-dir", str(shm_dir)))
    try:
        try:
            client = ServerRolloutEngine([ServerEndpoint(url)], timeout_s=300, transport="inband",
                                         shm_dir=str(shm_dir))
        except Exception:
            print((tmp_path / "serve.log").read_text()[-4000:])
            raise
        reqs = make_requests(tok)
        assert_greedy(hf_model, client.generate(reqs, params()), "served base weights")
        first = perturbed(hf_model)
        client.sync_full(first)
        assert_greedy(first, client.generate(reqs, params()), "served after the first shared-directory sync")
        learner = perturbed(first)
        t0 = time.perf_counter()
        client.sync_full(learner)
        sync_s = time.perf_counter() - t0
        synced = client.generate(reqs, params())
        assert_greedy(learner, synced, "served after the second shared-directory sync")
        assert not client.quarantined
        bad = {k: v.clone() for k, v in full_weights(learner).items()}
        bad["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
        transport = InbandTransport(timeout_s=120, shm_dir=str(shm_dir))
        failed = transport.push_full(bad, [ServerEndpoint(url)])
        transport.close()
        assert "refused (HTTP 422)" in failed[url] and "model.layers.0.mlp.up_proj.weight" in failed[url], failed
        again = client.generate(reqs, params())
        assert [r.response_token_ids for r in again] == [r.response_token_ids for r in synced]
        phases = [u for u in httpx.get(url + "/rm/info/", timeout=30).json()["updates"]
                  if u["endpoint"] == "rm/update_weights_shm"]
        assert len(phases) == 2 and all(k in phases[-1] for k in ("decode_s", "load_s")), phases
        record("serve_shm_sync", seconds=sync_s, bytes=client.transport().last_push["bytes"],
               client=client.transport().last_push, server=phases[-1])
        client.close()
        assert not list(shm_dir.iterdir()), "staging files outlived their transports"
    finally:
        _stop(proc)
        shutil.rmtree(shm_dir, ignore_errors=True)


@pytest.mark.parametrize("worker_path", [False, True], ids=["server-process-receiver", "vllm-worker-receiver"])
def test_serve_vllm_nccl_transport_sync_and_refused_bad_bucket(text_dir, tok, stop_ids, hf_model, worker_path):
    """The NCCL transport into the vLLM server engine on the GPU. One GPU cannot hold two NCCL ranks (NCCL refuses a
    duplicate device), so the group runs the torch backend's gloo wire (the learner pushes from the CPU); everything
    after the wire is the GPU path: buckets staged, checked, loaded into vLLM. ``vllm-worker-receiver`` runs the
    tensor-parallel path (receive, stage and check inside vLLM's worker through ``collective_rpc``) with TP=1."""
    from trainer.bench.async_rollouts import serve_engines
    from trainer.rollout.server_client import ServerEndpoint, ServerRolloutEngine
    from trainer.server.vllm_engine import VllmServerEngine
    from trainer.sync.weights import full_weights

    engine = VllmServerEngine(text_dir, max_model_len=512, gpu_memory_utilization=0.12, dtype="bfloat16",
                              engine_kwargs=EAGER)
    if worker_path:
        engine._multi_worker = lambda: True
    try:
        with serve_engines([engine]) as urls:
            client = ServerRolloutEngine([ServerEndpoint(urls[0])], timeout_s=300, transport="nccl",
                                         nccl_backend="torch", group_port=_free_port())
            client.transport().device = torch.device("cpu")
            reqs = make_requests(tok)
            base = client.generate(reqs, params())
            assert_greedy(hf_model, base, "served base weights")
            learner = perturbed(hf_model)
            t0 = time.perf_counter()
            client.sync_full(learner)
            sync_s = time.perf_counter() - t0
            assert not client.quarantined, client.quarantined
            synced = client.generate(reqs, params())
            assert_greedy(learner, synced, "served after an NCCL-transport sync")
            assert [r.response_token_ids for r in synced] != [r.response_token_ids for r in base]
            bad = copy.deepcopy(learner)
            with torch.no_grad():
                bad.get_parameter("model.layers.0.mlp.up_proj.weight").fill_(float("nan"))
            failed = client.transport().push_full(full_weights(bad), [ServerEndpoint(urls[0])])
            msg = failed.get(urls[0], "")
            assert "refused (HTTP 422)" in msg and "model.layers.0.mlp.up_proj.weight" in msg, failed
            again = engine.generate(reqs, params())
            assert [r.response_token_ids for r in again] == [r.response_token_ids for r in synced]
            record(f"serve_nccl_transport_sync[{'worker' if worker_path else 'server'}]", seconds=sync_s,
                   wire="torch-gloo")
            client.close()
    finally:
        engine.close()


def _stage2_config(tmp_path, kind, rm_vllm, steps=6, warmup=600, model=None):
    model_cfg = {"path": str(model)} if model else {"tiny": kind}
    return {
        "model": {**model_cfg, "torch_dtype": "bfloat16"},
        "data": {"synthetic": {"num_samples": 64, "seed": 0, "min_objects": 1, "max_objects": 3, "image_size": 64}},
        "training": {"output_dir": str(tmp_path / "run"), "max_steps": steps, "per_device_train_batch_size": 8,
                     "learning_rate": 2e-4, "logging_steps": 1, "seed": 0, "disable_tqdm": True,
                     "report_to": ["jsonl"], "bf16": True, "packing": True, "packing_length": 4096},
        "stage1": {"steps": warmup, "learning_rate": 3e-3, "batch_size": 16},
        "custom": {"extra": {"rollout_matching": {
            "rollout_backend": "vllm", "rollout_generate_batch_size": 8,
            "decoding": {"max_new_tokens": 160, "temperature": 0.0},
            "matching": {"mask_iou_threshold": 0.3, "candidate_top_k": 3, "mask_resolution": 128},
            "vllm": {"max_model_len": 2048, "enforce_eager": True, **rm_vllm}}}},
    }


def _stage2_rows(summary):
    from trainer.telemetry import read_jsonl

    return [r for r in read_jsonl(summary.metrics_path) if r.get("phase") == "stage2" and "loss" in r]


def stage2_colocate_check(kind: str, level: int, out_dir: Path) -> dict:
    """Six stage-2 steps with the vLLM colocate backend at ``level`` in this process; the measured values."""
    from trainer.config.schema import validate_config
    from trainer.sft.run import run_training

    cfg = _stage2_config(out_dir, kind, {"mode": "colocate", "sleep_level": level, "gpu_memory_utilization": 0.2})
    t0 = time.perf_counter()
    summary = run_training(validate_config(cfg))
    rows = _stage2_rows(summary)
    assert len(rows) == 6 and all(r["loss"] == r["loss"] for r in rows)
    matched = sum(r.get("rollout/matched", 0) for r in rows)
    assert matched > 0, rows
    keys = [k for k in rows[-1] if k.startswith("time/")]
    return {"seconds": time.perf_counter() - t0, "matched": matched, "gt": sum(r.get("rollout/gt", 0) for r in rows),
            "losses": [r["loss"] for r in rows], **{k: sum(r.get(k, 0.0) for r in rows) / len(rows) for k in keys}}


@pytest.mark.parametrize("kind,level", [("text", 2), ("vl", 1)])
def test_stage2_training_with_vllm_colocate(tmp_path, kind, level):
    """Each run in a fresh process (``in_fresh_process``): both use a sleep-mode engine."""
    record(f"stage2_colocate[{kind},sleep{level}]", **in_fresh_process("stage2", kind, str(level), str(tmp_path),
                                                                      timeout=900))


def test_stage2_training_server_mode_one_gpu(tmp_path):
    from trainer.config.schema import validate_config
    from trainer.modeling.fixtures import save_tiny_model
    from trainer.sft.run import run_training

    model_dir = save_tiny_model(tmp_path / "model", "text")
    url, proc = _serve(model_dir, tmp_path / "serve.log", util=0.2)
    try:
        cfg = _stage2_config(tmp_path, "text", {"mode": "server", "server": {"servers": [{"base_url": url}],
                                                                              "timeout_s": 300},
                                                "sync": {"transport": "inband", "mode": "full"}}, model=model_dir)
        try:
            summary = run_training(validate_config(cfg))
        except Exception:
            print((tmp_path / "serve.log").read_text()[-4000:])
            raise
        rows = _stage2_rows(summary)
        assert len(rows) == 6
        matched = sum(r.get("rollout/matched", 0) for r in rows)
        assert matched > 0, rows
        info = httpx.get(url + "/rm/info/", timeout=30).json()
        inband = [u for u in info["updates"] if u["transport"] == "inband"]
        assert len(inband) >= 6, info["updates"]
        keys = [k for k in rows[-1] if k.startswith("time/")]
        record("stage2_server_one_gpu", matched=matched, syncs=len(inband), losses=[r["loss"] for r in rows],
               **{k: sum(r.get(k, 0.0) for r in rows) / len(rows) for k in keys})
    finally:
        _stop(proc)


CHECKS = {"sleep": lambda level: sleep_check(int(level) if level.isdigit() else level), "recorded_load": recorded_load_check,
          "overlap_wake": overlap_wake_check, "merge_into_engine": merge_into_engine_check,
          "stage2": lambda kind, level, out: stage2_colocate_check(kind, int(level), Path(out))}

if __name__ == "__main__" and sys.argv[1:2] and sys.argv[1] in CHECKS:
    print("CHECK_RESULT " + json.dumps(CHECKS[sys.argv[1]](*sys.argv[2:])), flush=True)
