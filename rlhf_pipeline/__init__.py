"""RLHF with PPO, faithful to OpenAI's lm-human-preferences, as a reproducible DVC pipeline."""

__version__ = "0.1.0"
