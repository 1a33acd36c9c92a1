"""Moved to ``trainer.config.vllm`` (the schema package owns every config section); re-exported here for old imports."""

from trainer.config.vllm import (  # noqa: F401
    VllmConfig,
    VllmServerConfig,
    VllmServerEntry,
    VllmSyncConfig,
)
