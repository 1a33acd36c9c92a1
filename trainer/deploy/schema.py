"""Moved to ``trainer.config.deploy`` (the schema package owns every config section); re-exported here for old imports."""

from trainer.config.deploy import (  # noqa: F401
    DeployConfig,
    HostVolume,
    ImagesConfig,
    LearnerDeploy,
    ResourcesConfig,
    ServerDeploy,
)
