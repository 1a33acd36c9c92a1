"""Build the configured rollout engine. No silent fallback: ``rollout_backend: hf`` is the explicit alternative."""

from __future__ import annotations

from trainer.config.schema import RolloutMatchingConfig
from trainer.extras import require
from trainer.modeling.coord_vocab import stop_token_ids
from trainer.modeling.loading import LoadedModel
from trainer.rollout.base import RolloutEngine


def build_rollout_engine(rm: RolloutMatchingConfig, loaded: LoadedModel, model) -> RolloutEngine:
    if rm.rollout_backend == "hf":
        from trainer.rollout.hf import HFRolloutEngine

        return HFRolloutEngine(model, loaded.tokenizer.pad_token_id, sorted(stop_token_ids(loaded.tokenizer)),
                               rm.rollout_generate_batch_size, loaded.image_token_id)
    if rm.vllm.mode == "server":
        from trainer.rollout.server_client import ServerRolloutEngine

        return ServerRolloutEngine.from_config(rm, loaded)
    require("vllm", "custom.extra.rollout_matching.rollout_backend: vllm (colocate; "
                    "or set rollout_backend: hf explicitly)")
    from trainer.rollout.vllm_colocate import VllmColocateEngine

    return VllmColocateEngine.from_config(rm, loaded)
