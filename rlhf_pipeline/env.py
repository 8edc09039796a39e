"""Process-wide environment: offline hubs and quiet tools.

Applied by the entry points (:mod:`rlhf_pipeline.offline`), never by importing the library, so
every stage, the CLI, the flow and the tests run offline even when the caller forgot to export
the variables. ``setdefault`` lets a user with hub access opt back in by exporting e.g.
``HF_HUB_OFFLINE=0`` explicitly.
"""

from __future__ import annotations

import os
from pathlib import Path

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


def project_root() -> Path:
    """The directory holding params.yaml: the working directory where DVC runs stages."""
    return Path(os.environ.get("RLHF_PROJECT_ROOT", os.getcwd()))


def configure_offline_environment() -> None:
    for key, value in OFFLINE_DEFAULTS.items():
        os.environ.setdefault(key, value)
    # A project-local Prefect home keeps flows, the database and logs beside the repo.
    os.environ.setdefault("PREFECT_HOME", str(project_root() / ".prefect"))
