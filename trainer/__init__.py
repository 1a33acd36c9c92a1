"""rollout-matching: on-policy rollout training runtime for (vision-)language models."""

__version__ = "0.1.0"
