"""The summary a retrain run leaves in Prefect: a markdown artifact (stages, metrics against HEAD
and against the previous run, the policy's lineage) and a table artifact of the metrics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from flows.retrain.dvc_project import capture, dvc_command, rlhf_command, workspace_metrics

LAST_METRICS_RELATIVE_PATH = Path(".dvc") / "tmp" / "retrain" / "last_metrics.json"


def _metrics_table(metrics: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"file": path, "metric": name, "value": value}
        for path, values in metrics.items()
        for name, value in values.items()
    ]


def _previous_run_diff(root: Path, metrics: dict[str, dict[str, Any]]) -> str:
    path = root / LAST_METRICS_RELATIVE_PATH
    try:
        previous = json.loads(path.read_text())
    except (OSError, ValueError):
        return "_No previous run recorded._"
    rows = ["| File | Metric | Previous run | This run | Change |", "|---|---|---|---|---|"]
    for file in sorted(set(previous) | set(metrics)):
        old, new = previous.get(file, {}), metrics.get(file, {})
        for name in sorted(set(old) | set(new)):
            a, b = old.get(name, "-"), new.get(name, "-")
            change = (
                f"{b - a:+.6g}" if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b)) else ""
            )
            rows.append(f"| {file} | {name} | {a} | {b} | {change} |")
    return "\n".join(rows)


def _save_metrics(root: Path, metrics: dict[str, dict[str, Any]]) -> None:
    path = root / LAST_METRICS_RELATIVE_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(metrics, indent=2, sort_keys=True, default=str))


def publish_summary(
    root: Path, report: dict[str, Any], lineage_target: str | None, error: BaseException | None = None
) -> str:
    """Create the ``retrain-summary`` markdown and ``retrain-metrics`` table artifacts."""
    metrics = workspace_metrics(root)
    lines = [f"# Retrain: {report['status']}", "", f"- Repository: `{root}`"]
    if pulled := report.get("pulled"):
        lines.append(
            f"- Pulled from Label Studio: {pulled.get('added', pulled['rows'])} new label(s) "
            f"({pulled['annotations']} annotations of {pulled['tasks']} tasks on the server; agreement "
            f"{pulled['agreement']}; cancelled {pulled['cancelled']}, skipped {pulled['skipped']})"
        )
    ingested = report.get("ingested")
    if ingested:
        lines.append(
            f"- Ingested `{ingested['source']}` -> `{ingested['target']}` "
            f"({'new data' if ingested['changed'] else 'same as before'}; {ingested['tracked']})"
        )
    if report.get("recorded"):
        lines.append(f"- Recorded in git: {report['recorded']}")
    if report.get("promotion"):
        lines.append(f"- Promotion gate: {report['promotion']} (artifact `promotion-decision`)")
    lines.append(f"- Push: {report.get('push', 'not attempted')}")
    if report["stages"]:
        lines += ["", "## Stages", "", "| Stage | Result | Attempts |", "|---|---|---|"]
        lines += [f"| {s['stage']} | {s['result']} | {s['attempts']} |" for s in report["stages"]]
    if error is not None:
        lines += ["", "## Failure", "", "```text", str(error), "```"]
    diff = capture(dvc_command("metrics", "diff", "HEAD", "--md"), root)
    lines += ["", "## Metrics against HEAD", ""]
    lines.append(
        diff.output.strip()
        if diff.returncode == 0 and diff.output.strip()
        else f"_Not available: {(diff.stderr.strip() or 'no output').splitlines()[-1]}_"
    )
    lines += ["", "## Metrics against the previous run", "", _previous_run_diff(root, metrics)]
    if lineage_target:
        lineage = capture(rlhf_command("lineage", lineage_target), root, timeout=300)
        lines += ["", f"## Lineage of `{lineage_target}`", ""]
        if lineage.returncode == 0 and lineage.output.strip():
            lines += ["```text", lineage.output.strip(), "```"]
        else:
            reason = (lineage.stderr.strip() or lineage.output.strip() or f"exit {lineage.returncode}").splitlines()[-1]
            lines.append(f"_Not available: {reason}_")
    markdown = "\n".join(lines) + "\n"
    create_markdown_artifact(markdown=markdown, key="retrain-summary", description=f"Retrain run: {report['status']}")
    table = _metrics_table(metrics)
    if table:
        create_table_artifact(table=table, key="retrain-metrics", description="Workspace metrics (dvc metrics show)")
    if error is None:
        _save_metrics(root, metrics)
    return markdown
