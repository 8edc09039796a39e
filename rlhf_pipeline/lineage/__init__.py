"""``rlhf lineage PATH``: where a DVC-tracked artifact came from, read from the audit trail itself.

Everything comes from what DVC and git already record, read through DVC's Python API
(``dvc.repo.Repo``): the stage that produced PATH and the hashes ``dvc.lock`` holds for it;
whether the workspace still matches (DVC's own stage status, and for a directory the files that
differ from the tree in the DVC cache); the params the stage ran with and how the params files
differ since; its inputs, walked back through DVC's stage graph to the sources, with the base
model's provenance and the preference data's size and validation verdict; the git commit that
recorded the lock; the stage's metrics, package versions and device.

- :mod:`.record`: the DVC repo, the producing stage and its upstream stages, per-entry status;
- :mod:`.facts`: what the artifacts say about themselves (model cards, row counts, verdicts);
- :mod:`.event`: one OpenLineage ``RunEvent`` (``--json``), custom facets included;
- :mod:`.render`: the text report.
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
