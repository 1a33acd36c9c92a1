"""Shared fixtures: the embedded tokenizer, parse vocab and a saved tiny model directory (built in code, no hub), and
rollout requests encoded with a chat template."""

from __future__ import annotations

import os
import signal
import warnings
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, settings

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_PLUGINS", "")

# Property tests (hypothesis) whose verdict is a function of the commit: the examples are derived from each test's
# code (derandomize: no random seed, no example database carried over from an earlier run), and no timing check can
# fail them on a slow or loaded machine (no per-example deadline, no too-slow health check). A test that sets its own
# suppress_health_check replaces this list, so it names too_slow itself.
settings.register_profile("rollout-matching", derandomize=True, database=None, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("rollout-matching")


#: handlers a test must not leave behind: a process forked later (a multiprocessing worker) inherits them, and a
#: handler that does not exit keeps that worker alive through its pool's SIGTERM (a CI run hung on it on 2026-11-28)
GUARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@pytest.fixture(autouse=True)
def signal_handlers_restored(request):
    """Each test leaves SIGTERM / SIGINT / SIGHUP as it found them: a changed handler is put back and named in a
    warning (the test session's warnings summary), so the test that leaks one is known."""
    before = {sig: signal.getsignal(sig) for sig in GUARDED_SIGNALS}
    yield
    for sig, handler in before.items():
        if signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)
            warnings.warn(f"{request.node.nodeid} left a {signal.Signals(sig).name} handler installed; restored",
                          stacklevel=1)


@pytest.fixture(scope="session", autouse=True)
def deepspeed_ops_built_in_background(request, tmp_path_factory):
    """See ``tests/deepspeed_ops.py``; ``RM_TEST_BUILD_DS_OPS_INLINE=1`` leaves the builds to the tests."""
    from tests import deepspeed_ops

    if not deepspeed_ops.wanted([item.nodeid for item in request.session.items]):
        yield
        return
    proc = deepspeed_ops.start(tmp_path_factory.mktemp("deepspeed_ops") / "build.log")
    yield
    deepspeed_ops.stop(proc)


@pytest.fixture(scope="session")
def tokenizer():
    from trainer.modeling.fixtures import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture(scope="session")
def vocab(tokenizer):
    from trainer.modeling.coord_vocab import build_parse_vocab

    return build_parse_vocab(tokenizer)


@pytest.fixture(scope="session")
def tiny_text_dir(tmp_path_factory):
    from trainer.modeling.fixtures import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "text", "text", seed=0)


@pytest.fixture(scope="session")
def tiny_tok(tiny_text_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_text_dir)


def _chat_requests(tok, scenes: int | Sequence[str], prefix: str = "s"):
    """One ``RolloutRequest`` per scene, id ``<prefix><i>``: the user turn ``Detect every object.\nScene: <scene>``
    encoded with ``tok``'s chat template (generation prompt appended, no special tokens added). ``scenes``: the
    scene texts, or a count ``n`` for ``thing 0`` … ``thing n-1``."""
    from trainer.rollout.types import RolloutRequest

    if isinstance(scenes, int):
        scenes = [f"thing {i}" for i in range(scenes)]
    out = []
    for i, scene in enumerate(scenes):
        msgs = ({"role": "user", "content": f"Detect every object.\nScene: {scene}"},)
        text = tok.apply_chat_template(list(msgs), tokenize=False, add_generation_prompt=True)
        out.append(RolloutRequest(f"{prefix}{i}", msgs, tuple(tok(text, add_special_tokens=False)["input_ids"])))
    return out


@pytest.fixture(scope="session")
def chat_requests():
    """``chat_requests(tok, scenes, prefix="s")`` → the encoded ``RolloutRequest``s (``_chat_requests``)."""
    return _chat_requests
