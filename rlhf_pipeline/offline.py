"""Importing this module puts the process offline and quiet; the entry points import it first.

The stage scripts, the ``rlhf`` command, the retrain flow, the benchmarks and the test suite start
with ``import rlhf_pipeline.offline`` (ruff's import sorting keeps it in a section of its own,
ahead of the libraries that read these variables when they are imported: transformers, datasets,
huggingface_hub, Prefect). Importing the library itself (``import rlhf_pipeline``, or any of its
modules) changes nothing in the caller's environment.
"""

from __future__ import annotations

from rlhf_pipeline.env import configure_offline_environment

configure_offline_environment()
