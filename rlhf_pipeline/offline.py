"""Importing this module puts the process offline and quiet; the entry points import it first.

The stage scripts, the ``rlhf`` command, the retrain flow, the benchmarks and the test suite start
with ``import rlhf_pipeline.offline`` (ruff's import sorting keeps it in a section of its own,
ahead of the libraries that read these variables when they are imported: transformers, datasets,
huggingface_hub, Prefect). Importing the library itself (``import rlhf_pipeline``, or any other of
its modules) changes nothing in the caller's environment.

``setdefault`` lets a user with hub access opt back in by exporting e.g. ``HF_HUB_OFFLINE=0``.
"""

from __future__ import annotations

import os

OFFLINE_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_ETAG_TIMEOUT": "5",
    "HF_HUB_DOWNLOAD_TIMEOUT": "10",
    "DVC_NO_ANALYTICS": "1",
    "GX_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "TOKENIZERS_PARALLELISM": "false",
    "TQDM_MININTERVAL": "5",
    # Hugging Face's own download/load/save bars: the stages print their own progress lines
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
}


def configure_offline_environment() -> None:
    for key, value in OFFLINE_DEFAULTS.items():
        os.environ.setdefault(key, value)
    # A project-local Prefect home keeps flows, the database and logs beside the repo (the project
    # root is where DVC runs stages: the working directory, unless RLHF_PROJECT_ROOT says otherwise).
    root = os.environ.get("RLHF_PROJECT_ROOT", os.getcwd())
    os.environ.setdefault("PREFECT_HOME", os.path.join(root, ".prefect"))


configure_offline_environment()
