"""``labelling``: where each retrain run's new labels come from (read by the retrain flow, by no stage).

One key says where the labels are: ``data.preferences.source``, the one file the preferences stage
reads. This section says how a retrain run brings labels into that file before the stages run, so
that every run's labels are a tracked file and the stages stay reproducible (they never talk to a
server).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlhf_pipeline.params import Strict

SIMULATED_LABELS, FILE_LABELS, LABEL_STUDIO = "simulated", "file", "label_studio"
LABEL_FILE_SUFFIXES = (".jsonl", ".parquet")  # the formats a run can bring labels into


class LabellingParams(Strict):
    source: Literal["simulated", "file", "label_studio"] = Field(
        SIMULATED_LABELS,
        description="simulated: a run brings in no labels (data.preferences.source is read as it stands: the "
        "simulated labeller by default; an --incoming file is refused). file: the run's --incoming file, validated, "
        "replaces the file data.preferences.source. label_studio: the run pulls label_studio_project's annotations "
        "from the server at $LABEL_STUDIO_URL ($LABEL_STUDIO_API_KEY) and appends them to that file, every round "
        "kept.",
    )
    label_studio_project: int | None = Field(
        None, gt=0, description="label_studio: the project's id (the number in its URL)."
    )
    # the bounds of `rlhf label import` (a server's answer, or a file typed by hand): what it refuses
    server_timeout_s: float = Field(
        60.0, gt=0, le=3600, description="The whole exchange with the labelling server, in seconds (exit 1 past it)."
    )
    max_export_mb: float = Field(
        256.0,
        gt=0,
        le=16384,
        description="The largest export read, from the server or a file, in MiB (exit 3 over it).",
    )
    max_annotations_per_task: int = Field(
        100, ge=1, le=100_000, description="More annotations of one task than this are refused (exit 3)."
    )

    @property
    def max_export_bytes(self) -> int:
        return int(self.max_export_mb * (1 << 20))

    allow_plain_http: bool = Field(
        False,
        description="Send the API token over plain http:// to a host other than this machine (it travels in clear).",
    )
