"""``rlhf lineage PATH``: where a DVC-tracked artifact came from, read through DVC's Python API
(``dvc.repo.Repo``) and git: the producing stage and its locked hashes, whether the workspace still
matches, the params it ran with and how they changed since, its inputs walked back to the sources,
the commit that recorded the lock, metrics, package versions and device.

:mod:`.record` reads DVC's record, :mod:`.facts` what the artifacts say about themselves,
:mod:`.event` builds the OpenLineage ``RunEvent`` (``--json``) and :mod:`.render` the text report.
"""

from __future__ import annotations

import json

from rlhf_pipeline.lineage.event import build_lineage
from rlhf_pipeline.lineage.render import render_text

__all__ = ["build_lineage", "lineage_cli", "render_text"]


def lineage_cli(path: str, as_json: bool = False) -> int:
    event = build_lineage(path)
    print(json.dumps(event, indent=2, default=str) if as_json else render_text(event))
    return 0
