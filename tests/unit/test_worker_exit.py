"""``trainer.launch.worker_exit.exit_process``: a torch.distributed worker runs its exit handlers, flushes and
leaves with the code, without the interpreter's finalization; any other process exits the normal way."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import atexit, sys
    from trainer.launch.worker_exit import exit_process

    class Finalized:
        def __del__(self):  # runs in the interpreter's finalization only
            sys.stderr.write("finalized\\n")

    keep = Finalized()
    atexit.register(lambda: open(sys.argv[1], "w").write("exit handler ran"))
    sys.stdout.write("buffered, no newline")
    exit_process(7)
""")


def _run(tmp_path, world_size: str | None) -> tuple[subprocess.CompletedProcess, str]:
    env = {k: v for k, v in __import__("os").environ.items() if k != "WORLD_SIZE"}
    if world_size is not None:
        env["WORLD_SIZE"] = world_size
    marker = tmp_path / f"marker-{world_size}"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(marker)], capture_output=True, text=True, env=env,
                          timeout=60)
    return proc, marker.read_text() if marker.is_file() else ""


def test_a_distributed_worker_runs_exit_handlers_flushes_and_skips_finalization(tmp_path):
    proc, marker = _run(tmp_path, "2")
    assert proc.returncode == 7
    assert marker == "exit handler ran"
    assert proc.stdout == "buffered, no newline", "the buffered output was flushed"
    assert "finalized" not in proc.stderr, "the interpreter's finalization (and the C++ teardown after it) is skipped"


def test_any_other_process_exits_the_normal_way(tmp_path):
    proc, marker = _run(tmp_path, None)
    assert proc.returncode == 7 and marker == "exit handler ran" and proc.stdout == "buffered, no newline"
    assert "finalized" in proc.stderr
