"""`rlhf models list`: every registered version of every declared artifact, with its stages and the
metrics its commit recorded, as rows (``--json``) or a table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf_pipeline.registry import dangling_stages, declared_artifacts, metrics_at, recorded_hash, versions


def listing(root: str | Path) -> list[dict[str, Any]]:
    """Every registered version of every declared artifact, newest first, with its metrics."""
    rows = []
    for name in declared_artifacts(root):
        for version in versions(root, name):
            rows.append(
                {
                    "artifact": name,
                    "version": version.version,
                    "stages": list(version.stages),
                    "registered": version.created_at,
                    "commit": version.commit,
                    "names_a_model": recorded_hash(root, version) is not None,
                    **metrics_at(root, version.commit),
                }
            )
        for stage in dangling_stages(root, name):
            rows.append(
                {
                    "artifact": name,
                    "version": None,
                    "stages": [stage["stage"]],
                    "registered": "",
                    "commit": stage["commit"],
                    "names_a_model": False,
                    "dangling": stage["tag"],
                }
            )
    return rows


def render_listing(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no registered versions yet: the retrain flow registers one per new policy (or `rlhf models gate`)"

    def value(row: dict, key: str, se: str | None = None) -> str:
        number = row.get(key)
        if number is None:
            return "-"
        return f"{number:+.3f} ± {row[se]:.3f}" if se and row.get(se) is not None else f"{number:.3f}"

    lines = [
        "| artifact | version | stage | registered | gold gain (base σ) | proxy gain (base σ) | KL | RM accuracy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        stages = ", ".join(row["stages"]) or "-"
        if row.get("dangling"):  # a stage tag whose version's tag was deleted
            lines.append(
                f"| {row['artifact']} | (none) | {stages} (dangling: {row['dangling']} points at commit "
                f"{row['commit'][:12]}, which has no version tag) | - | - | - | - | - |"
            )
            continue
        if not row.get("names_a_model", True):  # a tag pushed by hand onto a commit without a run
            stages += " (not a version: its commit's dvc.lock records no model)"
        lines.append(
            f"| {row['artifact']} | {row['version']} | {stages} | {row['registered'][:19]} "
            f"| {value(row, 'gold gain', 'gold SE')} | {value(row, 'proxy gain', 'proxy SE')} | {value(row, 'KL')} "
            f"| {value(row, 'RM accuracy')} |"
        )
    return "\n".join(lines)
