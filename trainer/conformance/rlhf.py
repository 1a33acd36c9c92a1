"""Direction (b) of the conformance check: ms-swift's GRPO trainer (``swift rlhf``, argv built by our launcher from
``configs/summary_1024_attr_key_recall.yaml`` shrunk to the shape's model, ``use_vllm: true``, ``vllm_mode: server``)
against OUR server (``python -m trainer serve --engine vllm``). Sampling at ``GRPO_TEMPERATURE`` (1.0), and besides
the config's summary rewards (constant at random weights: no parseable summary) the run scores
``signal.length_distinct`` (``trainer/grpo/signal_reward.py``, added to the argv with its plugin), which differs
between a prompt's completions, so GRPO has advantages to learn from (``trainer.conformance.swift_logs`` reads them
back)."""

from __future__ import annotations

import contextlib
import json
import shlex
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainer.conformance.peers import (
    HOST,
    REPO,
    Peer,
    nccl_lines,
    peer_env,
    placement,
    run_logged,
    swift_cli,
)
from trainer.conformance.protocol import access_log, started_and_probed
from trainer.conformance.rollout import MODEL_TYPE, NEW_TOKENS, TEMPLATE
from trainer.conformance.swift_logs import grpo_step_summary, learning_signal, log_records, step_metrics, step_seconds
from trainer.launch.ports import listen_port as free_port  # below the ephemeral range

SUMMARY_CONFIG = "configs/summary_1024_attr_key_recall.yaml"
GRPO_TEMPERATURE = 1.0  # > 0: a prompt's num_generations completions must differ, or their rewards cannot
SIGNAL_REWARD = "signal.length_distinct"  # trainer/grpo/signal_reward.py (module docstring there)
SIGNAL_REWARD_WEIGHT = 1.0
SIGNAL_PLUGIN = REPO / "trainer/grpo/signal_reward.py"


@dataclass(frozen=True)
class RlhfShape:
    """The model and GRPO settings of the rlhf direction. ``text``: a random Qwen3 text model (the 0.6B shape on a
    GPU, tiny on the CPU) on the summary rows without images, the protocol check. ``4b``: a random
    Qwen3-VL-4B on the summary rows with ~1024x1024 images, the summary config's DoRA r32 on ViT + LLM, completions of
    the config's 2048 tokens (random weights never stop), gradient checkpointing, CUDA graphs on the server."""

    name: str
    model_type: str
    template: str
    images: bool
    image_size: int
    max_completion_length: int
    max_length: int
    per_device_train_batch_size: int
    num_generations: int
    generation_batch_size: int
    max_steps: int
    gradient_checkpointing: bool
    max_model_len: int
    enforce_eager: bool


RLHF_SHAPES = {
    "text": RlhfShape("text", MODEL_TYPE, TEMPLATE, images=False, image_size=64, max_completion_length=NEW_TOKENS,
                      max_length=1024, per_device_train_batch_size=2, num_generations=2, generation_batch_size=4,
                      max_steps=2, gradient_checkpointing=False, max_model_len=2048, enforce_eager=True),
    "4b": RlhfShape("4b", "qwen3_vl", "qwen3_vl", images=True, image_size=1024, max_completion_length=2048,
                    max_length=8192, per_device_train_batch_size=4, num_generations=4, generation_batch_size=4,
                    max_steps=3, gradient_checkpointing=True, max_model_len=8192, enforce_eager=False),
}


def serve_argv(model_dir: Path, port: int, shape: RlhfShape = RLHF_SHAPES["text"], util: float = 0.3) -> list[str]:
    """Our server as our launcher builds it (``trainer.launch.commands.trainer_serve_command``)."""
    from trainer.launch.commands import ServerOptions, trainer_serve_command

    return trainer_serve_command(ServerOptions(
        engine="vllm", host=HOST, port=port, model=str(model_dir), gpu_memory_utilization=util,
        max_model_len=shape.max_model_len,
        extra=[*(["--enforce-eager"] if shape.enforce_eager else []), "--dtype", "bfloat16"])).argv


def text_rows(src: Path, dst: Path) -> Path:
    """The summary rows without images (a text model), as in ``tests/grpo/test_swift_grpo_cpu.py``."""
    with dst.open("w", encoding="utf-8") as out:
        for line in src.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            row.pop("images", None)
            row["messages"][-1]["content"] = row["messages"][-1]["content"].replace("<image>", "")
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    return dst


def grpo_config(work: Path, model_dir: Path, port: int, group_port: int, *, bf16: bool = True,
                shape: RlhfShape = RLHF_SHAPES["text"], server_util: float = 0.3) -> Path:
    """``summary_1024_attr_key_recall.yaml`` at ``shape``'s sizes, one learner, server mode on ``port``."""
    import yaml

    from trainer.grpo.summary_data import write_dataset

    data = write_dataset(work / "summary_data", num_samples=16, seed=3, image_size=shape.image_size)
    rows = data if shape.images else text_rows(data, work / "text.jsonl")
    cfg = work / "peers_grpo.yaml"
    cfg.write_text(yaml.safe_dump({
        "extends": str(REPO / SUMMARY_CONFIG),
        "model": {"path": str(model_dir), "torch_dtype": "bfloat16" if bf16 else "float32"},
        "data": {"train_jsonl": str(rows)},
        "training": {"output_dir": str(work / "grpo_out"), "bf16": bf16, "deepspeed": None,
                     "per_device_train_batch_size": shape.per_device_train_batch_size,
                     "gradient_accumulation_steps": 1, "max_steps": shape.max_steps, "save_steps": 0,
                     "gradient_checkpointing": shape.gradient_checkpointing, "report_to": []},
        "rlhf": {"model_type": shape.model_type, "template": shape.template, "use_vllm": True, "vllm_mode": "server",
                 "vllm_server_host": [HOST], "vllm_server_port": [port], "vllm_server_group_port": [group_port],
                 "vllm_server_timeout": 60, "num_generations": shape.num_generations,
                 "temperature": GRPO_TEMPERATURE,
                 "generation_batch_size": shape.generation_batch_size,
                 "max_completion_length": shape.max_completion_length, "max_length": shape.max_length,
                 "dynamic_sample": False},
        "custom": {"extra": {"rollout_server": {"vllm_data_parallel_size": 1, "vllm_tensor_parallel_size": 1,
                                                "vllm_max_model_len": shape.max_model_len,
                                                "vllm_gpu_memory_utilization": server_util,
                                                "vllm_limit_mm_per_prompt": {"image": 1} if shape.images else None,
                                                "gpus": None, "learner_gpus": None}}},
    }, allow_unicode=True))
    return cfg


def rlhf_command(cfg_path: Path, gpus: list[int] | None = None) -> tuple[list[str], dict[str, str]]:
    """``swift rlhf`` argv + env exactly as ``python -m trainer launch learner`` builds it (one process), with
    ``swift`` replaced by ``python -m swift.cli.main``."""
    from trainer.config.loader import resolve_yaml
    from trainer.config.schema import validate_config
    from trainer.launch.commands import learner_command

    config = validate_config(resolve_yaml(cfg_path), source=str(cfg_path))
    cmd = learner_command(str(cfg_path), config, nproc=1, gpus=gpus)
    assert cmd.argv[:2] == ["swift", "rlhf"], cmd.argv
    return swift_cli("rlhf") + cmd.argv[2:], dict(cmd.env)


def server_timings(url: str) -> dict[str, float]:
    """What our server measured over the run, from its ``/metrics``: ``/infer/`` calls and seconds, new tokens,
    accepted weight syncs and their seconds (server side: receive + load; ``trainer.server.metrics``)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    with httpx.Client(timeout=30.0, trust_env=False) as c:
        text = c.get(url + "/metrics").text
    want = {"rm_server_infer_latency_seconds_count": "infer_calls", "rm_server_infer_latency_seconds_sum": "infer_s",
            "rm_server_generated_tokens_total": "generated_tokens", "rm_server_prompt_tokens_total": "prompt_tokens",
            "rm_server_weight_sync_seconds_count": "syncs", "rm_server_weight_sync_seconds_sum": "sync_s"}
    out = {v: 0.0 for v in want.values()}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name in want:
                out[want[sample.name]] += sample.value
    return out


def extend_list_flag(argv: list[str], flag: str, values: list[str]) -> list[str]:
    """``argv`` with ``values`` appended to the list that follows ``flag`` (``flag`` and them at the end when
    absent)."""
    if flag not in argv:
        return [*argv, flag, *values]
    i = argv.index(flag) + 1
    while i < len(argv) and not argv[i].startswith("--"):
        i += 1
    return [*argv[:i], *values, *argv[i:]]


def with_template_ids_plugin(argv: list[str]) -> list[str]:
    """``argv`` with ``trainer/conformance/swift_template_ids.py`` added to its ``--external_plugins`` (after the ones
    there)."""
    return extend_list_flag(argv, "--external_plugins", [str(Path(__file__).with_name("swift_template_ids.py"))])


def with_signal_reward(argv: list[str]) -> list[str]:
    """``argv`` with ``SIGNAL_REWARD`` scored too: its plugin in ``--external_plugins``, its name in
    ``--reward_funcs`` and, where the config weighs its rewards, ``SIGNAL_REWARD_WEIGHT`` in ``--reward_weights``
    (the config schema only knows the summary rewards, so it is added here, not in the YAML)."""
    out = extend_list_flag(argv, "--external_plugins", [str(SIGNAL_PLUGIN)])
    out = extend_list_flag(out, "--reward_funcs", [SIGNAL_REWARD])
    if "--reward_weights" in out:
        out = extend_list_flag(out, "--reward_weights", [f"{SIGNAL_REWARD_WEIGHT:g}"])
    return out


def run_rlhf(out: Path, work: Path, model_dir: Path, deadline: float, result: dict[str, Any], save,
             shape: RlhfShape = RLHF_SHAPES["text"], device_count: int = 0) -> None:
    port, group_port = free_port(), free_port()
    url = f"http://{HOST}:{port}"
    r: dict[str, Any] = result.setdefault("rlhf", {"worked": [], "failed": {}})
    where = placement(device_count)
    r["shape"], r["placement"] = asdict(shape), where["layout"]
    argv = serve_argv(model_dir, port, shape, where["server_util"])
    server = Peer(argv, out / "logs/trainer_serve.log", env=peer_env(where["server_env"]))
    r["server"] = {"command": shlex.join(argv), "env": where["server_env"]}
    try:
        if not started_and_probed(url, server, min(300.0, deadline - time.monotonic() - 40), r, save):
            return
        cfg = grpo_config(work, model_dir, port, group_port, shape=shape, server_util=where["server_util"])
        argv_rlhf, env = rlhf_command(cfg, where["learner_gpus"])
        argv_rlhf = with_signal_reward(argv_rlhf)
        env["MASTER_PORT"] = str(free_port())
        if shape.images:  # the embedded tokenizer's image ids for ms-swift's Qwen-VL template (module docstring)
            argv_rlhf = with_template_ids_plugin(argv_rlhf)
            env["RM_SWIFT_TOKENIZER_DIR"] = str(model_dir)
        (out / "logs/peers_grpo.yaml").write_text(cfg.read_text())
        r["learner"] = {"env": env, "temperature": GRPO_TEMPERATURE,
                        "added_reward": {"name": SIGNAL_REWARD, "weight": SIGNAL_REWARD_WEIGHT,
                                         "plugin": str(SIGNAL_PLUGIN.relative_to(REPO))}}
        r["learner"].update(run_logged(argv_rlhf, out / "logs/swift_rlhf.log",
                                       deadline - time.monotonic() - 20, env=peer_env(env), cwd=work))
        text = (out / "logs/swift_rlhf.log").read_text(errors="replace")
        r["learner"]["nccl_lines"] = nccl_lines(text)
        r["learner"]["connected"] = "Connected to vLLM server" in text
        logs = sorted((work / "grpo_out").glob("*/logging.jsonl"))
        records = [json.loads(x) for x in logs[0].read_text().splitlines() if x.strip()] if logs else []
        r["learner"]["metrics_source"] = "logging.jsonl" if records else "swift_rlhf.log"
        r["per_step"] = step_metrics(records or log_records(text))
        r["learning_signal"] = learning_signal(r["per_step"])
        steps = [x.get("global_step/max_steps") for x in records if "global_step/max_steps" in x]
        r["learner"]["steps"] = steps
        r["learner"]["rewards"] = [{k: v for k, v in x.items() if k.startswith("reward")} for x in records
                                   if "reward" in x][:3]
        if r["learner"]["connected"]:
            r["worked"].append("connect_and_init_communicator_request")
        if steps:
            r["worked"].append(f"grpo_steps {steps[-1]}")
        if r["learning_signal"]["ok"]:
            r["worked"].append("learning_signal")
        if r["learner"]["rc"] != 0:
            r["failed"]["swift_rlhf"] = r["learner"].get("error")
        (out / "logs").joinpath("grpo_logging.jsonl").write_text("\n".join(json.dumps(x) for x in records))
        with contextlib.suppress(Exception):  # the server may have died; then there is nothing to read
            r["server"]["timings"] = server_timings(url)
            r["timing"] = grpo_step_summary(step_seconds(records), r["server"]["timings"], records)
    except Exception as exc:  # noqa: BLE001 - our side failed building the run: recorded, not raised
        r["failed"]["runner"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
    finally:
        server.stop()
        r["server"].update({k: v for k, v in server.record().items() if k != "command"})
        text = server.log.read_text(errors="replace")
        r["server"]["nccl_lines"] = nccl_lines(text)
        r["server"]["requests"] = access_log(text)
        save()
