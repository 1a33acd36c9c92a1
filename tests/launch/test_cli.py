"""``python -m trainer launch …`` end to end: the server launcher really execs the stub rollout server and
refuses a taken port; the learner launcher health-checks real servers before exec'ing, and fails with the
servers' names when they never become healthy. There is no combined launcher."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from tests.launch.conftest import REPO, child_env, free_port, start_trainer, stop
from trainer.cli import build_parser
from trainer.launch import cli as launch_cli
from trainer.launch import ports
from trainer.launch.health import process_exited, wait_until_healthy

SUMMARY = str(REPO / "configs/summary_1024.yaml")
STAGE2 = str(REPO / "configs/rollout_matching_sft_template.yaml")


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:  # timeout: bounds a hang only
    return subprocess.run([sys.executable, "-m", "trainer", *args], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_only_server_and_learner_launchers():
    parser = build_parser()
    launch = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "launch")[1]
    sub = next(a for a in launch._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == {"server", "learner"}


def test_server_launcher_execs_and_refuses_taken_port(tmp_path):
    port = free_port()
    proc = start_trainer(["launch", "server", "--engine", "scripted", "--port", str(port)], tmp_path / "srv.log")
    try:  # 600 s bounds a hang only: a server process that exits stops the wait at once
        wait_until_healthy([f"http://127.0.0.1:{port}"], timeout_s=600, interval_s=0.2,
                           abort=process_exited(proc, (tmp_path / "srv.log").read_text))
        assert proc.poll() is None
        second = run_cli("launch", "server", "--engine", "scripted", "--port", str(port))
        assert second.returncode == launch_cli.EXIT_PORT
        assert f"port {port} on 127.0.0.1 is not free" in second.stderr
        assert f"pid {proc.pid}" in second.stderr  # exec kept the launcher's pid: the holder is named
    finally:
        stop(proc)
    log = (tmp_path / "srv.log").read_text()
    assert "launch: exec " in log and "serve --engine scripted" in log


def test_print_command_does_not_start_anything():
    out = run_cli("launch", "server", "--engine", "swift", "--config", SUMMARY, "--print-command")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("CUDA_VISIBLE_DEVICES=0,1,2,3,4,5 swift rollout --model /models/Qwen3-VL-4B")
    out = run_cli("launch", "learner", "--config", SUMMARY, "--print-command", "--master-port", "23456")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("CUDA_VISIBLE_DEVICES=6,7 MASTER_PORT=23456 NPROC_PER_NODE=2 ") and \
        " swift rlhf " in out.stdout
    assert "launch: rendezvous port 23456 (--master-port)" in out.stderr


def test_invalid_config_lists_every_problem(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"extends: {SUMMARY}\ncustom:\n  extra:\n    rollout_server:\n      vllm_enable_lora: true\n"
                   "      learner_gpus: [5, 6]\n")
    out = run_cli("launch", "server", "--engine", "swift", "--config", str(bad), "--print-command")
    assert out.returncode == launch_cli.EXIT_CONFIG
    assert "custom.extra.rollout_server.vllm_enable_lora" in out.stderr
    assert "custom.extra.rollout_server.learner_gpus" in out.stderr


def test_learner_fails_naming_servers_that_never_became_healthy(tmp_path):
    urls = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    here = tmp_path / "here.yaml"  # the template with what this machine has: the launcher checks the model path first
    # a text model: the CPU build of vLLM here cannot run a vision-language one (the preflight refuses that first)
    here.write_text(f"extends: {STAGE2}\nmodel:\n  path: null\n  tiny: text\n")
    out = run_cli("launch", "learner", "--config", str(here), "--wait-for-servers", ",".join(urls),
                  "--health-timeout-s", "1", "--health-interval-s", "0.2")
    assert out.returncode == launch_cli.EXIT_UNHEALTHY
    assert "2 rollout server(s) not healthy after 1s" in out.stderr
    assert all(u in out.stderr for u in urls)


def _learner_args(**kw) -> argparse.Namespace:
    base = dict(config=STAGE2, nproc_per_node=None, gpus=None, wait_for_servers=None, health_timeout_s=60.0,
                health_interval_s=0.2, master_port=None, print_command=False, resume="never", extra=[])
    base.update(kw)
    return argparse.Namespace(**base)


def test_learner_waits_for_slow_server_then_execs(scripted_server, monkeypatch):
    url, _ = scripted_server()  # still starting: the learner must wait, not fail
    executed = []
    monkeypatch.setattr(launch_cli, "_exec", lambda cmd: executed.append(cmd) or 0)
    rc = launch_cli.run_learner(_learner_args(wait_for_servers=url, gpus="0,1", health_timeout_s=600.0))
    assert rc == 0 and len(executed) == 1
    assert executed[0].argv[1:5] == ["-m", "torch.distributed.run", "--nproc_per_node", "2"]
    rounds = []  # it really was healthy when exec happened: the first probe passes, no second round
    wait_until_healthy([url], timeout_s=600, request_timeout_s=60, sleep=rounds.append)
    assert rounds == []


def test_learner_wait_for_config_servers(monkeypatch, tmp_path):
    port = free_port()
    cfg = tmp_path / "grpo.yaml"
    cfg.write_text(f"extends: {SUMMARY}\nrlhf:\n  vllm_server_port: [{port}]\n")
    executed = []
    monkeypatch.setattr(launch_cli, "_exec", lambda cmd: executed.append(cmd) or 0)
    rc = launch_cli.run_learner(_learner_args(config=str(cfg), wait_for_servers="config", health_timeout_s=0.5))
    assert rc == launch_cli.EXIT_UNHEALTHY and executed == []
    rc = launch_cli.run_learner(_learner_args(config=STAGE2, wait_for_servers="config"))
    assert rc == launch_cli.EXIT_CONFIG  # the stage-2 template is not in server mode


@pytest.fixture
def launched(monkeypatch):
    """The commands ``run_learner`` would exec, with no MASTER_PORT / NNODES in the environment."""
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.delenv("NNODES", raising=False)
    executed = []
    monkeypatch.setattr(launch_cli, "_exec", lambda cmd: executed.append(cmd) or 0)
    return executed


def _master_port(cmd) -> int:
    return int(cmd.env["MASTER_PORT"] if "MASTER_PORT" in cmd.env else cmd.argv[cmd.argv.index("--master-port") + 1])


def test_each_learner_launch_gets_its_own_free_rendezvous_port(launched, capsys):
    for config in (STAGE2, STAGE2, SUMMARY):  # torchrun takes --master-port; swift rlhf reads MASTER_PORT
        assert launch_cli.run_learner(_learner_args(config=config)) == 0
    chosen = [_master_port(cmd) for cmd in launched]
    assert len(set(chosen)) == 3 and 29500 not in chosen, chosen
    assert all(p < ports.ephemeral_range()[0] for p in chosen), chosen
    err = capsys.readouterr().err
    assert all(f"launch: rendezvous port {p} (free now; --master-port or MASTER_PORT chooses it)" in err
               for p in chosen), err


def test_an_explicit_rendezvous_port_is_kept(launched, monkeypatch, capsys):
    assert launch_cli.run_learner(_learner_args(master_port=23456)) == 0
    monkeypatch.setenv("MASTER_PORT", "23457")
    assert launch_cli.run_learner(_learner_args(config=SUMMARY)) == 0
    assert launch_cli.run_learner(_learner_args(master_port=23458)) == 0  # the flag beats the environment
    assert [_master_port(cmd) for cmd in launched] == [23456, 23457, 23458]
    err = capsys.readouterr().err
    assert "rendezvous port 23456 (--master-port)" in err and "rendezvous port 23457 (MASTER_PORT)" in err


@pytest.mark.parametrize("env, message", [({"MASTER_PORT": "29x00"}, "MASTER_PORT: '29x00' is not a port"),
                                          ({"MASTER_PORT": "70000"}, "MASTER_PORT: '70000' is not a port"),
                                          ({"NNODES": "2"}, "NNODES=2: every node's learner must use the same")])
def test_a_rendezvous_port_that_cannot_work_is_refused(launched, monkeypatch, capsys, env, message):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert launch_cli.run_learner(_learner_args()) == launch_cli.EXIT_CONFIG and launched == []
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "65536", "http"])
def test_master_port_flag_must_be_a_port(value, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["launch", "learner", "--config", STAGE2, "--master-port", value])
    assert "must be a port (1-65535)" in capsys.readouterr().err


def test_learner_nproc_must_match_gpus(capsys):
    rc = launch_cli.run_learner(_learner_args(nproc_per_node=3, gpus="0,1"))
    assert rc == launch_cli.EXIT_CONFIG and "one process per learner GPU" in capsys.readouterr().err


def test_missing_executable_is_reported(monkeypatch, capsys):
    from trainer.launch.commands import LaunchCommand

    rc = launch_cli._exec(LaunchCommand(["definitely-not-a-command-xyz"], {}))
    assert rc == launch_cli.EXIT_NOT_FOUND and "not found on PATH" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["launch", "learner", "--config", SUMMARY, "--health-timeout-s", "0"]])
def test_bad_timeout_rejected(argv):
    out = run_cli(*argv)
    assert out.returncode == 2 and "must be > 0" in out.stderr
