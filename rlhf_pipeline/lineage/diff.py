"""``rlhf lineage --diff A B``: what changed between two versions of an artifact (registry
versions such as ``policy@v1``, or ``PATH@REV`` for any git revision): the preference rows added
and removed (from the rows' content hashes), the params, the code files, the packages, and the
metrics. Each side is the lineage event of that version, read at its commit (nothing checked out).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from typing import Any

from rlhf_pipeline import registry
from rlhf_pipeline.environment import compare
from rlhf_pipeline.errors import SettingsError, quoted
from rlhf_pipeline.gitrepo import resolve_rev
from rlhf_pipeline.lineage import facts, record
from rlhf_pipeline.lineage.event import build_lineage
from rlhf_pipeline.paths import PREFERENCES

CODE_SUFFIXES = (".py",)


def target(root: str, spec: str) -> tuple[str, str, str]:
    """``(label, path, commit)`` of a version: ``NAME@VERSION``/``NAME#STAGE`` from the registry, or
    ``PATH@REV`` (a path of the project at a git revision: a branch, tag, sha, ``HEAD~1``)."""
    if "@" not in spec and "#" not in spec:
        raise SettingsError(
            f"--diff {quoted(spec)}: name a version (policy@v1, policy#prod) or PATH@REV (models/policy@HEAD~1)."
        )
    name = spec.split("@")[0].split("#")[0]
    if name in registry.declared_artifacts(root):
        version = registry.resolve(root, spec)
        return version.tag, registry.artifact_path(root, name), version.commit
    path, _, rev = spec.rpartition("@")
    return spec, project_path(path, "--diff"), resolve_rev(root, rev, "--diff")


def project_path(path: str, what: str) -> str:
    """``path`` when it names a place inside the project (relative, no ``..``, printable); else
    SettingsError (exit 2): a revision's path is read from git, never from the file system outside."""
    parts = path.replace("\\", "/").split("/")
    if not path or len(path) > 1024 or path.startswith("/") or ".." in parts or not path.isprintable():
        raise SettingsError(
            f"{what} {quoted(path)}@...: PATH must be a path inside the project, relative to its root (such as "
            "models/policy), with no '..'; nothing was read."
        )
    return path


def preference_rows(repo) -> Counter[str] | None:
    """A content hash per preference row (every split), read at the repo's revision from DVC's
    cache; None when the data is not in the cache."""
    import pyarrow as pa

    rows: Counter[str] = Counter()
    try:
        files = [f for f in repo.dvcfs.find(PREFERENCES) if f.endswith(".arrow")]
        for name in sorted(files):
            with repo.dvcfs.open(name, "rb") as handle:
                table = pa.ipc.open_stream(handle.read()).read_all()
            for row in table.to_pylist():
                rows[hashlib.sha256(json.dumps(row, sort_keys=True, default=str).encode()).hexdigest()] += 1
    except Exception:  # an object missing from the cache: the counts are unknown, not zero
        return None
    return rows


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, name + "/"))
        else:
            out[name] = value
    return out


def _params(event: dict[str, Any]) -> dict[str, Any]:
    run = event["run"]["facets"]
    values = dict(run["parameters"]["values"])
    for stage_values in run["upstreamParameters"]["stages"].values():
        values.update(stage_values)
    return values


def _inputs(event: dict[str, Any]) -> dict[str, str | None]:
    return {d["name"]: d["facets"]["dvc"]["hash"] for d in event["inputs"]}


def _metrics(repo) -> dict[str, Any]:
    """Every metrics file dvc.yaml declares, as the repo's revision recorded it (the version's
    evaluation included: it is downstream of the policy, so no lineage event of it carries it)."""
    shown = repo.metrics.show().get("", {}).get("data", {})
    return _flat({path: found.get("data", {}) for path, found in shown.items() if "data" in found})


def _changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: {"old": old.get(k), "new": new.get(k)} for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}


def diff_versions(root: str, spec_a: str, spec_b: str, namespace: str | None = None) -> dict[str, Any]:
    from dvc.repo import Repo

    (label_a, path_a, rev_a), (label_b, path_b, rev_b) = target(root, spec_a), target(root, spec_b)
    event_a = build_lineage(f"{root}/{path_a}", namespace, rev_a)
    event_b = build_lineage(f"{root}/{path_b}", namespace, rev_b)
    repo_a, repo_b = Repo(root, rev=rev_a), Repo(root, rev=rev_b)
    rows_a, rows_b = preference_rows(repo_a), preference_rows(repo_b)
    inputs = _changes(_inputs(event_a), _inputs(event_b))
    env_a, env_b = (e["run"]["facets"]["environment"].get("recorded") or {} for e in (event_a, event_b))
    return {
        "from": {"version": label_a, "commit": rev_a, "event": event_a},
        "to": {"version": label_b, "commit": rev_b, "event": event_b},
        "changes": {
            "preferenceRows": None
            if rows_a is None or rows_b is None
            else {
                "before": sum(rows_a.values()),
                "after": sum(rows_b.values()),
                "added": sum((rows_b - rows_a).values()),
                "removed": sum((rows_a - rows_b).values()),
            },
            "params": _changes(_params(event_a), _params(event_b)),
            "code": {k: v for k, v in inputs.items() if k.endswith(CODE_SUFFIXES)},
            "data": {k: v for k, v in inputs.items() if not k.endswith(CODE_SUFFIXES)},
            "environment": compare(env_a, env_b, facts.lock_texts(root)) if env_a and env_b else None,
            "metrics": _changes(_metrics(repo_a), _metrics(repo_b)),
        },
    }


def render_diff(result: dict[str, Any]) -> str:
    a, b, changes = result["from"], result["to"], result["changes"]
    lines = [f"Lineage diff {a['version']} ({a['commit'][:12]}) -> {b['version']} ({b['commit'][:12]})", ""]
    rows = changes["preferenceRows"]
    lines.append(
        "Preference rows: "
        + (
            f"{rows['before']} -> {rows['after']} (+{rows['added']} added, -{rows['removed']} removed)"
            if rows
            else "unknown (the data of a side is not in the DVC cache: `dvc fetch` it)"
        )
    )
    sections = (("Params", changes["params"]), ("Code files", changes["code"]), ("Data and models", changes["data"]))
    for title, items in sections:
        lines += ["", f"{title} ({len(items)} changed)"]
        lines += [f"  {k}: {record.show(c['old'])} -> {record.show(c['new'])}" for k, c in items.items()] or [
            "  (none)"
        ]
    env = changes["environment"]
    lines += ["", "Environment"]
    if env is None:
        lines.append("  unknown: a side's model card records no environment")
    elif env["same"]:
        lines.append("  the same packages")
    else:
        lines += [f"  {n}: {c['then']} -> {c['now']}" for n, c in env["packages"].items()] or [f"  {env['note']}"]
    lines += ["", f"Metrics ({len(changes['metrics'])} changed)"]
    for key, change in changes["metrics"].items():
        old, new = change["old"], change["new"]
        delta = f"  ({new - old:+.4g})" if all(isinstance(v, (int, float)) for v in (old, new)) else ""
        lines.append(f"  {key}: {record.show(old)} -> {record.show(new)}{delta}")
    return "\n".join(lines)
