"""RLHF with PPO, faithful to OpenAI's lm-human-preferences, as a reproducible DVC pipeline."""

from rlhf_pipeline.env import configure_offline_environment

configure_offline_environment()

__version__ = "0.1.0"
