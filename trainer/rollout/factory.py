"""Build the configured rollout engine. No silent fallback: ``rollout_backend: hf`` is the explicit alternative."""

from __future__ import annotations

import importlib

from trainer.config.schema import RolloutMatchingConfig
from trainer.extras import require
from trainer.modeling.coord_vocab import stop_token_ids
from trainer.modeling.loading import LoadedModel
from trainer.rollout.base import RolloutEngine

VLLM_ENGINES = {"colocate": "trainer.rollout.vllm_colocate", "server": "trainer.rollout.server_client"}


def build_rollout_engine(rm: RolloutMatchingConfig, loaded: LoadedModel, model) -> RolloutEngine:
    if rm.rollout_backend == "hf":
        from trainer.rollout.hf import HFRolloutEngine

        hf = rm.hf
        return HFRolloutEngine(model, loaded.tokenizer.pad_token_id, sorted(stop_token_ids(loaded.tokenizer)),
                               rm.rollout_generate_batch_size, loaded.image_token_id,
                               cache_implementation=hf.cache_implementation, compile=hf.compile,
                               compile_mode=hf.compile_mode, prompt_pad_multiple=hf.prompt_pad_multiple)
    module_name = VLLM_ENGINES[rm.vllm.mode]
    if rm.vllm.mode == "colocate":
        require("vllm", "custom.extra.rollout_matching.rollout_backend: vllm (colocate; or set rollout_backend: hf)")
    return importlib.import_module(module_name).engine_from_config(rm, loaded, model)
