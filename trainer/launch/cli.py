"""``python -m trainer launch {server,learner}``: start one rollout server or one learner (never both).

``launch server`` checks the port is free, pins the server's GPUs and execs ``swift rollout`` or
``python -m trainer serve`` (so the exit code is the server's; 75: its engine died, restart it, see
``trainer.server.fatal``). ``launch learner`` optionally waits for every server's ``/health/`` (one
deadline), then execs ``swift rlhf`` (``grpo_summary`` configs) or ``torchrun -m trainer train`` (stage 2) on a
rendezvous port of its own: ``--master-port``, else ``MASTER_PORT``, else a free port chosen then (and printed), so
two learners on one node do not both take torchrun's 29500.
``--resume auto`` (stage 2) resumes from the newest complete checkpoint under ``training.output_dir`` when there is
one, else starts fresh: the same command restarts a killed learner where its last checkpoint left it (the chart's
learner pods run with it). ``--print-command`` prints the command instead of running it. Arguments after ``--`` go
to that command.
"""

from __future__ import annotations

import argparse
import os
import sys

from trainer.config.errors import ConfigError, ConfigErrors
from trainer.config.grpo import GRPO_VARIANT
from trainer.config.loader import resolve_yaml
from trainer.config.schema import TrainConfig, validate_config
from trainer.launch.commands import (
    LaunchCommand,
    ServerOptions,
    config_server_urls,
    learner_command,
    server_command,
    server_endpoint_for,
    trainer_variant,
)
from trainer.launch.gpus import parse_gpus
from trainer.launch.health import ServersNotHealthyError, wait_until_healthy
from trainer.launch.ports import PortInUseError, ensure_port_free, listen_port
from trainer.launch.resume import STAGE2_DIR, latest_checkpoint
from trainer.sft.cpu_threads import bind_process, physical_cores_of, server_cpu_affinity

EXIT_CONFIG = 2
EXIT_PORT = 3
EXIT_UNHEALTHY = 4
EXIT_NOT_FOUND = 127

INSTALL_HINTS = {"swift": "ms-swift is not installed here: pip install 'rollout-matching[swift]' (or use the "
                          "rollout-server / learner image)"}


def _say(msg: str) -> None:
    print(f"launch: {msg}", file=sys.stderr, flush=True)


def _load(path: str) -> TrainConfig:
    """The validated, typed config (every problem on a line of its own, with its key path; GRPO warnings such as
    ignored ``rlhf.vllm_*`` fields are logged by the schema). The launchers read it by attribute."""
    try:
        return validate_config(resolve_yaml(path), source=path)
    except ConfigError as exc:  # the file or an ``extends`` it names
        raise ConfigError("", f"error: {exc}") from None
    except ConfigErrors as exc:
        raise ConfigError("", "\n".join(f"error: {e}" for e in exc.errors)) from None


def _say_each(exc: Exception) -> None:
    for line in str(exc).splitlines():
        _say(line)


def preflight_problems(config: TrainConfig) -> list[str]:
    """What the config needs of this machine and lacks (``trainer.config.preflight``), checked here once, before
    torchrun starts its ranks (each would print the same)."""
    from trainer.config.preflight import preflight

    return [str(p) for p in preflight(config)]


def _exec(cmd: LaunchCommand) -> int:
    _say(f"exec {cmd.shell()}")
    sys.stdout.flush()
    try:
        os.execvpe(cmd.argv[0], cmd.argv, {**os.environ, **cmd.env})
    except FileNotFoundError:
        _say(f"{cmd.argv[0]!r} not found on PATH. {INSTALL_HINTS.get(cmd.argv[0], '')}".rstrip())
        return EXIT_NOT_FOUND
    return 0  # pragma: no cover (exec does not return)


def _split_extra(argv_extra: list[str]) -> list[str]:
    return argv_extra[1:] if argv_extra[:1] == ["--"] else argv_extra


def run_server(args: argparse.Namespace) -> int:
    try:
        config = _load(args.config) if args.config else None
        opts = ServerOptions(
            engine=args.engine, host=args.host, port=args.port,
            gpus=parse_gpus(args.gpus) if args.gpus else None, model=args.model,
            tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
            gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
            enable_lora=args.enable_lora, model_type=args.model_type, template=args.template,
            extra=_split_extra(args.extra))
        cmd = server_command(opts, config)
        host, port = server_endpoint_for(opts, config)
    except (ConfigError, ValueError) as exc:
        _say_each(exc)
        return EXIT_CONFIG
    share = server_cpu_affinity(opts.gpus) if args.cpu_affinity == "node" else None
    if share is not None and share.cpus:
        threads = physical_cores_of(share.cpus) or len(share.cpus)
        cmd = LaunchCommand(cmd.argv, {**cmd.env, "OMP_NUM_THREADS": str(threads)})
    if args.print_command:
        bound = f"taskset -c {share.cpu_list} " if share is not None and share.cpus else ""
        print(bound + cmd.shell())
        return 0
    if share is not None:
        if share.cpus:
            bind_process(share.cpus)
        _say(f"cpu affinity: {share.cpu_list or 'not bound'} ({share.reason})")
    try:
        ensure_port_free(host, port)
    except PortInUseError as exc:
        _say(str(exc))
        return EXIT_PORT
    return _exec(cmd)


def requested_master_port(flag: int | None) -> tuple[int | None, str]:
    """The learner's rendezvous port the user asked for and where from: ``--master-port``, else ``MASTER_PORT``;
    ``(None, "")`` when neither names one (the launcher then chooses a free port). Refuses a ``MASTER_PORT`` that
    is no port, and a multi-node ``NNODES`` without a port (every node must use the same one)."""
    if flag is not None:
        return flag, "--master-port"
    env = os.environ.get("MASTER_PORT", "").strip()
    if env:
        if not env.isdigit() or not 0 < int(env) < 65536:
            raise ConfigError("MASTER_PORT", f"{env!r} is not a port (1-65535); fix or unset it (a free port is then "
                                             "chosen), or pass --master-port")
        return int(env), "MASTER_PORT"
    nnodes = os.environ.get("NNODES", "1").strip()
    if nnodes not in ("", "1"):
        raise ConfigError("--master-port", f"NNODES={nnodes}: every node's learner must use the same rendezvous "
                                           "port; pass --master-port (or set MASTER_PORT) on each node")
    return None, ""


def resume_checkpoint(mode: str, config: TrainConfig, nproc: int, extra: list[str]) -> str | None:
    """``--resume``: ``never`` → None; ``auto`` → the newest complete stage-2 checkpoint of the output directory
    (``--output-dir`` among the learner's extra arguments, else ``training.output_dir``), None when there is none."""
    if mode == "never":
        return None
    if trainer_variant(config) == GRPO_VARIANT:
        raise ConfigError("--resume", "auto resumes stage-2 (rollout_matching_sft) runs; a grpo_summary config "
                                      "(swift rlhf) starts fresh: drop --resume or pass --resume never")
    if "--resume-from-checkpoint" in extra:
        raise ConfigError("--resume", "auto and -- --resume-from-checkpoint both choose the checkpoint; keep one")
    output_dir = extra[extra.index("--output-dir") + 1] if "--output-dir" in extra[:-1] else config.training.output_dir
    found = latest_checkpoint(output_dir, nproc)
    where = os.path.join(str(output_dir), STAGE2_DIR)
    _say(f"resume auto: {found} (the newest complete checkpoint in {where})" if found is not None else
         f"resume auto: no complete checkpoint in {where}; starting fresh")
    return str(found) if found is not None else None


def run_learner(args: argparse.Namespace) -> int:
    try:
        config = _load(args.config)
        problems = [] if args.print_command else preflight_problems(config)
        if problems:
            raise ConfigError("", "\n".join(f"error: {p}" for p in problems))
        gpus = parse_gpus(args.gpus) if args.gpus else None
        if gpus is None and trainer_variant(config) == GRPO_VARIANT:
            rs = config.custom.extra.rollout_server
            gpus = list(rs.learner_gpus) if rs is not None and rs.learner_gpus else None
        nproc = args.nproc_per_node or (len(gpus) if gpus else 1)
        if gpus is not None and nproc != len(gpus):
            raise ConfigError("--nproc-per-node", f"{nproc} process(es) for {len(gpus)} GPU(s) {gpus}; "
                                                  "one process per learner GPU")
        port, port_source = requested_master_port(args.master_port)
        extra = _split_extra(args.extra)
        resume_from = resume_checkpoint(args.resume, config, nproc, extra)
        cmd = learner_command(args.config, config, nproc, gpus, extra, master_port=port, resume_from=resume_from)
        urls: list[str] = []
        if args.wait_for_servers == "config":
            urls = config_server_urls(config)
            if not urls:
                raise ConfigError("--wait-for-servers", "config: this config names no rollout servers (not server mode)")
        elif args.wait_for_servers:
            urls = [u.strip().rstrip("/") for u in args.wait_for_servers.split(",") if u.strip()]
    except (ConfigError, ValueError) as exc:
        _say_each(exc)
        return EXIT_CONFIG
    if urls and not args.print_command:
        _say(f"waiting up to {args.health_timeout_s:g}s for {len(urls)} server(s): {', '.join(urls)}")
        try:
            wait_until_healthy(urls, args.health_timeout_s, interval_s=args.health_interval_s, log=_say)
        except ServersNotHealthyError as exc:
            _say(str(exc))
            return EXIT_UNHEALTHY
    if port is None:
        try:
            port, port_source = listen_port(), "free now; --master-port or MASTER_PORT chooses it"
        except PortInUseError as exc:
            _say(f"no free rendezvous port: {exc}")
            return EXIT_PORT
        cmd = learner_command(args.config, config, nproc, gpus, extra, master_port=port, resume_from=resume_from)
    _say(f"rendezvous port {port} ({port_source})")
    if args.print_command:
        print(cmd.shell())
        return 0
    return _exec(cmd)


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"must be a port (1-65535), got {text}")
    return int(text)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("launch", help="start a rollout server or a learner (separately)", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="launch_what", metavar="{server,learner}")
    sub.required = True

    s = sub.add_parser("server", help="start one rollout server on its GPUs (fails fast if the port is taken)")
    s.add_argument("--engine", choices=["swift", "vllm", "hf", "scripted"], required=True,
                   help="swift: ms-swift's `swift rollout`; vllm/hf/scripted: `python -m trainer serve`")
    s.add_argument("--config", help="training config; swift: server settings from custom.extra.rollout_server")
    s.add_argument("--host", help="bind address (default: the config's, else 127.0.0.1)")
    s.add_argument("--port", type=int, help="port (default: the config's, else 8000)")
    s.add_argument("--gpus", help="GPU indices for CUDA_VISIBLE_DEVICES, e.g. 0,1,2,3,4,5")
    s.add_argument("--model", help="local model directory (default: the config's model.path)")
    s.add_argument("--tensor-parallel-size", type=int)
    s.add_argument("--data-parallel-size", type=int,
                   help="swift: engine replicas in this server; scripted: counted in its /get_world_size/")
    s.add_argument("--gpu-memory-utilization", type=float)
    s.add_argument("--max-model-len", type=int)
    s.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=None)
    s.add_argument("--model-type", help="swift only: ms-swift model type, e.g. qwen3_vl (default: rlhf.model_type)")
    s.add_argument("--template", help="swift only: ms-swift template (default: rlhf.template)")
    s.add_argument("--print-command", action="store_true", help="print the command and exit")
    s.add_argument("--cpu-affinity", choices=("off", "node"), default="off",
                   help="node: bind the server to the cores of its GPUs' blocks, one contiguous block of physical "
                   "cores per GPU of the host, with as many CPU threads (for several servers, or servers and a "
                   "learner with training.cpu_affinity: node, on one host); off: the OS places its threads")
    s.add_argument("extra", nargs=argparse.REMAINDER, help="-- ARGS… passed to the server command")
    s.set_defaults(func=run_server)

    learner = sub.add_parser("learner", help="start the learner (after optional server health checks)")
    learner.add_argument("--config", required=True)
    learner.add_argument("--nproc-per-node", type=int, help="learner processes (default: number of --gpus, else 1)")
    learner.add_argument("--gpus", help="GPU indices for CUDA_VISIBLE_DEVICES, e.g. 6,7 "
                                        "(GRPO default: custom.extra.rollout_server.learner_gpus)")
    learner.add_argument("--wait-for-servers", metavar="URL,…|config",
                         help="base URLs whose GET /health/ must answer 200 first; 'config' = the config's servers")
    learner.add_argument("--health-timeout-s", type=_positive_float, default=600.0,
                         help="one deadline for all servers (default 600)")
    learner.add_argument("--health-interval-s", type=_positive_float, default=2.0, help="poll interval (default 2)")
    learner.add_argument("--master-port", type=_port,
                         help="rendezvous port of the learner's processes (default: $MASTER_PORT, else a free port "
                              "below the ephemeral range, printed)")
    learner.add_argument("--resume", choices=["auto", "never"], default="never",
                         help="auto: resume stage 2 from the newest complete checkpoint under training.output_dir "
                              "when there is one, else start fresh (what a restarted pod runs); never (default): "
                              "start fresh")
    learner.add_argument("--print-command", action="store_true", help="print the command and exit")
    learner.add_argument("extra", nargs=argparse.REMAINDER, help="-- ARGS… passed to the learner command")
    learner.set_defaults(func=run_learner)
