"""How a ``python -m trainer`` process ends.

A torch.distributed worker (torchrun sets ``WORLD_SIZE``) that finished runs Python's exit handlers while the
interpreter is fully alive, flushes its streams and leaves with ``os._exit``, skipping the interpreter's finalization
and the C++ static destructors after it. There, on CPU (gloo), rank 1 of a finished two-rank run died with
"terminate called without an active exception" (SIGABRT, no Python frame left on any thread) after training had
written its outputs and the process group was destroyed: about 1 run in 25 on a loaded 2-core machine (3 of ~60;
once in a fresh-clone CI). torchrun then reports the whole job failed, and a Kubernetes Job would run it again. Any
other process exits the normal way."""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn


def exit_process(code: int) -> NoReturn:
    """Leave with ``code`` (module docstring)."""
    if "WORLD_SIZE" not in os.environ:
        sys.exit(code)
    atexit._run_exitfuncs()  # logging.shutdown, temporary directories, tqdm's monitor, ...
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing left to keep
            pass
    os._exit(code)
