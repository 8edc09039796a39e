"""The text report of ``rlhf lineage``: the OpenLineage event, for a person."""

from __future__ import annotations

import json
from typing import Any

from rlhf_pipeline.lineage.facts import PACKAGES
from rlhf_pipeline.lineage.record import files_note, show

STATUS_WORDS = {"ok": "up to date", "modified": "MODIFIED", "missing": "MISSING", "unknown": "not hashed"}


def _size(dvc: dict) -> str:
    from dvc.utils.humanize import naturalsize

    parts = [f"{dvc['nfiles']} files"] if dvc.get("nfiles") is not None else []
    parts += [naturalsize(dvc["size"])] if dvc.get("size") is not None else []
    return f" ({', '.join(parts)})" if parts else ""


def _status(status: str) -> str:
    return STATUS_WORDS.get(status, status.upper())


def _git_line(git: dict) -> str:
    if not git.get("commit"):
        return f"  git          not recorded ({git.get('note', 'unknown')})"
    bits = []
    if git.get("changedSinceCommit"):
        bits.append(f"{', '.join(git['changedSinceCommit'])} changed since that commit")
    if git.get("dirtyFiles"):
        dirty = git["dirtyFiles"]
        bits.append(f"uncommitted changes: {', '.join(dirty[:6])}{' ...' if len(dirty) > 6 else ''}")
    return f"  git          {git['commit']}  ({'DIRTY: ' + '; '.join(bits) if git.get('dirty') else 'clean'})"


def _summary(event: dict[str, Any]) -> list[str]:
    run, job = event["run"]["facets"], event["job"]
    artifact, stale = run["artifact"], run["stale"]
    out = next((o["facets"]["dvc"] for o in event["outputs"] if o["name"] == artifact["output"]), {})
    lines = [
        f"Lineage of {artifact['path']}",
        f"  stage        {job['name']}  (recorded in {run['dvcStages']['stages'][0]['recordedIn']})",
        f"  command      {job['facets']['sourceCode']['sourceCode']}",
        f"  output       {artifact['output']}  md5 {out.get('hash')}{_size(out)}",
    ]
    if artifact["path"] != artifact["output"]:
        lines.append(f"  file         {artifact['path']}  md5 {artifact.get('lockedHash')}")
    workspace = _status(artifact["status"]) + files_note(artifact)
    if artifact["status"] == "modified" and artifact.get("workspaceHash"):
        workspace += f"; workspace md5 {artifact['workspaceHash']}"
    lines += [f"  workspace    {workspace}", f"  run id       {event['run']['runId']}", _git_line(run["git"])]
    if not stale["stale"]:
        return [*lines, "  verdict      up to date: workspace, params and commands match dvc.lock"]
    lines.append("  verdict      STALE: `dvc repro` would change this lineage")
    lines += [f"                 - {reason}" for reason in stale["reasons"]]
    if stale["artifactModified"] and not any(artifact["output"] in r for r in stale["reasons"]):
        lines.append(f"                 - {artifact['path']} {artifact['status']} in the workspace")
    return lines


def _parameters(event: dict[str, Any]) -> list[str]:
    run, name = event["run"]["facets"], event["job"]["name"]
    lines = [f"Parameters (stage {name}, from {run['dvcStages']['stages'][0]['recordedIn']})"]
    lines += [f"  {k} = {show(v)}" for k, v in run["parameters"]["values"].items()] or ["  (none)"]
    for stage, values in run["upstreamParameters"]["stages"].items():
        lines.append(f"  upstream {stage}: " + ", ".join(f"{k}={show(v)}" for k, v in values.items()))
    lines.append("Changed in the params files since that run")
    changes = run["paramsDiff"]["changes"]
    lines += [
        f"  {k}: {show(c['old'])} -> {show(c['new'])}  (stage {', '.join(c['stages'])})" for k, c in changes.items()
    ] or ["  (none)"]
    lines.append("")
    lines.append("Stages (producing stage first, then upstream)")
    for report in run["dvcStages"]["stages"]:
        lines.append(f"  {report['name']}: {report['cmd'] or '(dvc add)'}")
        lines.append("      " + ("up to date" if not report["stale"] else "STALE: " + "; ".join(report["reasons"])))
    return lines


def _input_lines(dataset: dict[str, Any]) -> list[str]:
    facets = dataset["facets"]
    dvc = facets["dvc"]
    produced = dvc["producedBy"]
    origin = (
        f"from {produced}"
        if produced
        else "source" + (f", tracked by {dvc['trackedBy']}" if dvc.get("trackedBy") else "")
    )
    lines = [
        f"  {dataset['name']}",
        f"      md5 {dvc['hash']}{_size(dvc)} · {origin} · read by {', '.join(dvc['consumedBy'])} · "
        f"{_status(dvc['status'])}{files_note(dvc)}",
    ]
    if "baseModel" in facets:
        base = facets["baseModel"]
        provenance = f"source={base.get('source', '?')} source_sha256={base.get('source_sha256', '?')}"
        lines.append(f"      base model: {provenance} ({base['card']})")
    if "modelCard" in facets:
        card = {k: v for k, v in facets["modelCard"].items() if not k.startswith("_")}
        lines.append("      model card: " + ", ".join(f"{k}={v}" for k, v in card.items()))
    if "preferenceData" in facets:
        pref = facets["preferenceData"]
        rows = f"{pref['rows']} rows ({pref['rowsSource']})" if pref["rows"] is not None else "row count unknown"
        verdict = {True: "passed", False: "FAILED"}.get(pref["validation"]["success"], "no verdict found")
        lines.append(f"      preference data: {rows}; Great Expectations: {verdict} ({pref['validation']['summary']})")
    return lines


def render_text(event: dict[str, Any]) -> str:
    run = event["run"]["facets"]
    lines = [*_summary(event), "", *_parameters(event), "", "Inputs (walked back to the sources)"]
    for dataset in event["inputs"]:
        lines += _input_lines(dataset)
    if not event["inputs"]:
        lines.append("  (none)")
    lines += ["", f"Metrics (stage {event['job']['name']})"]
    lines += [
        f"  {path}: {json.dumps(values, sort_keys=True, default=str)}"
        for path, values in run["metrics"]["files"].items()
    ] or ["  (none declared)"]
    lines += [
        f"  upstream {path}: {json.dumps(values, sort_keys=True, default=str)}"
        for path, values in run["upstreamMetrics"]["files"].items()
    ]
    env = run["environment"]
    lines += [
        "",
        "Environment",
        "  " + ", ".join(f"{p} {env[p]}" for p in PACKAGES) + f", python {env['python']}",
        f"  device {env['device']} ({env['deviceSource']})",
    ]
    return "\n".join(lines)
