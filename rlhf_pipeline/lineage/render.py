"""The text report of ``rlhf lineage``: the OpenLineage event, for a person."""

from __future__ import annotations

import json
from typing import Any

from rlhf_pipeline import numerics
from rlhf_pipeline.lineage.event import build_lineage
from rlhf_pipeline.lineage.facts import PACKAGES
from rlhf_pipeline.lineage.record import files_note, show

STATUS_WORDS = {
    "ok": "up to date",
    "modified": "MODIFIED",
    "missing": "MISSING",
    "unknown": "not hashed",
    "recorded": "as recorded",
}


def _status(entry: dict) -> str:
    return STATUS_WORDS.get(entry["status"], entry["status"].upper()) + files_note(entry)


def _size(dvc: dict) -> str:
    from dvc.utils.humanize import naturalsize

    parts = [f"{dvc['nfiles']} files"] if dvc.get("nfiles") is not None else []
    parts += [naturalsize(dvc["size"])] if dvc.get("size") is not None else []
    return f" ({', '.join(parts)})" if parts else ""


def _git_line(git: dict) -> str:
    if not git.get("commit"):
        return f"  git          not recorded ({git.get('note', 'unknown')})"
    bits = (
        [f"{', '.join(git['changedSinceCommit'])} changed since that commit"] if git.get("changedSinceCommit") else []
    )
    dirty = git.get("dirtyFiles") or []
    bits += [f"uncommitted changes: {', '.join(dirty[:6])}{' ...' if len(dirty) > 6 else ''}"] if dirty else []
    return f"  git          {git['commit']}  ({'DIRTY: ' + '; '.join(bits) if git.get('dirty') else 'clean'})"


def _summary(event: dict[str, Any]) -> list[str]:
    run, job = event["run"]["facets"], event["job"]
    artifact, stale = run["artifact"], run["stale"]
    out = next((o["facets"]["dvc"] for o in event["outputs"] if o["name"] == artifact["output"]), {})
    lines = [
        f"Lineage of {artifact['path']}",
        f"  stage        {job['name']}  (recorded in {run['dvcStages']['stages'][0]['recordedIn']})",
        f"  command      {job['facets']['sourceCode']['sourceCode']}",
        f"  namespace    {job['namespace']}  ({_run_time(event['eventTime'], artifact.get('datedBy', 'outputs'))})",
        f"  output       {artifact['output']}  md5 {out.get('hash')}{_size(out)}",
    ]
    if artifact["path"] != artifact["output"]:
        lines.append(f"  file         {artifact['path']}  md5 {artifact.get('lockedHash')}")
    workspace = _status(artifact)
    if artifact["status"] == "modified" and artifact.get("workspaceHash"):
        workspace += f"; workspace md5 {artifact['workspaceHash']}"
    git = run["git"]
    lines += [f"  workspace    {workspace}", f"  run id       {event['run']['runId']}", _git_line(git)]
    if git.get("revision"):
        return [*lines, f"  verdict      as recorded at {git['revision']} (nothing compared with the workspace)"]
    if not stale["stale"]:
        return [*lines, "  verdict      up to date: workspace, params and commands match dvc.lock"]
    absent, changed = _absent_and_changed(stale["reasons"])
    absent = sorted(absent)
    if artifact["status"] == "missing" and not changed:
        return [
            *lines,
            "  verdict      NOT CHECKED OUT: dvc.lock records this run and nothing it recorded has changed;",
            "               its outputs are not in this workspace: `dvc pull` fetches them from the remote,",
            "               `dvc checkout` from a local cache",
            f"               (not here: {_listed(absent)})",
        ]
    lines.append("  verdict      STALE: `dvc repro` would change this lineage")
    lines += [f"                 - {reason}" for reason in changed]
    if absent:
        lines.append(f"                 - not checked out ({_listed(absent)}): `dvc pull` or `dvc checkout`")
    if stale["artifactModified"] and not any(artifact["output"] in r for r in stale["reasons"]):
        lines.append(f"                 - {artifact['path']} {artifact['status']} in the workspace")
    return lines


def _absent_and_changed(reasons: list[str]) -> tuple[list[str], list[str]]:
    """(the paths a reason says are missing, once each in order; every other reason). A missing one reads
    ``[STAGE: ]dep|out PATH missing`` (:func:`rlhf_pipeline.lineage.record.stage_reasons`)."""
    absent = [r.removesuffix(" missing").rsplit(" ", 1)[-1] for r in reasons if r.endswith(" missing")]
    return list(dict.fromkeys(absent)), [r for r in reasons if not r.endswith(" missing")]


def _stage_verdict(report: dict[str, Any]) -> str:
    """One stage's line: up to date, only its recorded files absent, or what changed."""
    if not report["stale"]:
        return "up to date"
    absent, changed = _absent_and_changed(report["reasons"])
    not_here = f"not checked out: {_listed(absent)}" if absent else ""
    return "; ".join(["STALE: " + "; ".join(changed), *([not_here] if not_here else [])]) if changed else not_here


def _run_time(moment: str, dated_by: str) -> str:
    """When the run finished, and what says so (its outputs' times, or the commit that recorded it)."""
    if dated_by.startswith("commit "):
        return f"run recorded by {dated_by} at {moment}, dated from git"
    if dated_by == "record file":
        return f"run recorded by {moment}, the record file's time"
    return f"run finished {moment}"


def _listed(paths: list[str], shown: int = 6) -> str:
    more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
    return ", ".join(paths[:shown]) + more


def _parameters(event: dict[str, Any]) -> list[str]:
    run, name = event["run"]["facets"], event["job"]["name"]
    lines = [f"Parameters (stage {name}, from {run['dvcStages']['stages'][0]['recordedIn']})"]
    lines += [f"  {k} = {show(v)}" for k, v in run["parameters"]["values"].items()] or ["  (none)"]
    for stage, values in run["upstreamParameters"]["stages"].items():
        lines.append(f"  upstream {stage}: " + ", ".join(f"{k}={show(v)}" for k, v in values.items()))
    lines.append("Changed in the params files since that run")
    lines += [
        f"  {k}: {show(c['old'])} -> {show(c['new'])}  (stage {', '.join(c['stages'])})"
        for k, c in run["paramsDiff"]["changes"].items()
    ] or ["  (none)"]
    lines += ["", "Stages (producing stage first, then upstream)"]
    for report in run["dvcStages"]["stages"]:
        lines.append(f"  {report['name']}: {report['cmd'] or '(dvc add)'}")
        lines.append("      " + _stage_verdict(report))
    return lines


def _input_lines(dataset: dict[str, Any]) -> list[str]:
    facets = dataset["facets"]
    dvc = facets["dvc"]
    tracked = f", tracked by {dvc['trackedBy']}" if dvc.get("trackedBy") else ""
    origin = f"from {dvc['producedBy']}" if dvc["producedBy"] else f"source{tracked}"
    lines = [
        f"  {dataset['name']}",
        f"      md5 {dvc['hash']}{_size(dvc)} · {origin} · read by {', '.join(dvc['consumedBy'])} · {_status(dvc)}",
    ]
    if base := facets.get("baseModel"):
        provenance = f"source={base.get('source', '?')} source_sha256={base.get('source_sha256', '?')}"
        # what the tokenizer puts before every sequence (a BOS); absent from the card when nothing
        provenance += f" sequence_prefix={(base.get('sequence_prefix') or {}).get('tokens') or 'none'}"
        lines.append(f"      base model: {provenance} ({base['card']})")
    if card := facets.get("modelCard"):
        lines.append("      model card: " + ", ".join(f"{k}={v}" for k, v in card.items() if not k.startswith("_")))
    if pref := facets.get("preferenceData"):
        rows = f"{pref['rows']} rows ({pref['rowsSource']})" if pref["rows"] is not None else "row count unknown"
        verdict = {True: "passed", False: "FAILED"}.get(pref["validation"]["success"], "no verdict found")
        lines.append(f"      preference data: {rows}; Great Expectations: {verdict} ({pref['validation']['summary']})")
        for entry in pref.get("rounds", []):
            lines.append("        " + _round_line(entry))
    return lines


def _unchanged_source(dvc: dict[str, Any]) -> bool:
    """A source file git tracks (not a stage's output, not DVC-tracked data) that is as dvc.lock recorded it."""
    return not dvc["producedBy"] and not dvc.get("trackedBy") and dvc["status"] in ("ok", "recorded")


def _round_line(entry: dict[str, Any]) -> str:
    """One labelling round of human preference data: its rows and the model that sampled them."""
    counts = ", ".join(f"{entry[k]} {k}" for k in ("tasks", "annotators") if k in entry)
    models = ", ".join(entry.get("model", [])) or "model unknown"
    weights = ", ".join(sha[:12] for sha in entry.get("model_sha256", []))
    sampled = f"{models} (weights sha256 {weights})" if weights else models
    rows = f"{entry.get('rows')} rows" + (f" ({counts})" if counts else "")
    return f"round {entry.get('round')}: {rows}, sampled by {sampled}"


def render_text(event: dict[str, Any]) -> str:
    run, env = event["run"]["facets"], event["run"]["facets"]["environment"]
    lines = [*_summary(event), "", *_parameters(event), "", "Inputs (walked back to the sources)"]
    # git-tracked sources (code, the lock file) as recorded: one line; each is in --json with its md5
    unchanged = [d for d in event["inputs"] if _unchanged_source(d["facets"]["dvc"])]
    shown = [d for d in event["inputs"] if d not in unchanged]
    lines += [line for dataset in shown for line in _input_lines(dataset)]
    if unchanged:
        names = [d["name"] for d in unchanged]
        lines.append(f"  {len(names)} sources in git, each as recorded: {_listed(names, 3)} (`--json` lists each)")
    lines += [] if event["inputs"] else ["  (none)"]
    lines += ["", f"Metrics (stage {event['job']['name']})"]
    for label, facet in (("", run["metrics"]), ("upstream ", run["upstreamMetrics"])):
        lines += [
            f"  {label}{path}: {json.dumps(v, sort_keys=True, default=str)}" for path, v in facet["files"].items()
        ]
        if not label and not facet["files"]:
            lines.append("  (none declared)")
    return "\n".join(
        [
            *lines,
            "",
            "Environment",
            "  " + ", ".join(f"{p} {env[p]}" for p in PACKAGES) + f", python {env['python']}",
            f"  device {env['device']} ({env['deviceSource']})",
            *_environment_lines(env),
        ]
    )


def _environment_lines(env: dict[str, Any]) -> list[str]:
    """The lock the artifact was made from, and a warning when the running packages differ."""
    recorded, comparison = env.get("recorded"), env.get("comparison") or {}
    lines = []
    if recorded:
        differs = recorded.get("differs_from_lock") or {}
        lines.append(
            f"  made with    {recorded.get('lock') or 'no lock'} sha256 {recorded.get('lock_sha256')}"
            + (f"; differing from it: {', '.join(differs)}" if differs else "; every package as locked")
        )
        lines.append(f"  cpu numerics {numerics.describe(recorded.get('cpu_numerics'))}")
    if comparison.get("same") is False:
        packages = comparison.get("packages") or {}
        listed = ", ".join(
            f"{n} {c['then'] or 'absent'} -> {c['now'] or 'absent'}" for n, c in list(packages.items())[:12]
        )
        more = f" ... and {len(packages) - 12} more" if len(packages) > 12 else ""
        lines.append(
            "  WARNING      the running environment differs from the one that made this artifact"
            + (f": {listed}{more}" if listed else f" ({comparison.get('note')})")
            + ". Reproduce it with `make setup` at the commit that recorded it."
        )
    elif comparison.get("same") is None and comparison.get("note"):
        lines.append(f"  note         {comparison['note']}")
    elif comparison.get("same"):
        lines.append("  running      the same packages (reproducible here)")
    return lines


def lineage_cli(path: str, as_json: bool = False, namespace: str | None = None, rev: str | None = None) -> int:
    """``rlhf lineage PATH [--rev REV] [--json] [--namespace NAME]``: the report, or the OpenLineage event."""
    event = build_lineage(path, namespace, rev)
    print(json.dumps(event, indent=2, default=str) if as_json else render_text(event))
    return 0
