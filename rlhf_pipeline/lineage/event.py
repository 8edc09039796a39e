"""The lineage of an artifact as one OpenLineage ``RunEvent``.

Standard facets where the spec has them (``sourceCode``, ``sourceCodeLocation``); every other
fact is a custom facet carrying ``_producer`` and a ``_schemaURL`` into ``schema.json`` beside
this module, which describes each of them as an extension of the spec's ``RunFacet`` or
``DatasetFacet`` (the tests validate events against the published spec and these definitions)."""

from __future__ import annotations

import os
import uuid
from typing import Any

from rlhf_pipeline import __version__
from rlhf_pipeline.errors import PipelineError, SettingsError
from rlhf_pipeline.lineage import facts, record

# What made the event: this package at its version, as a package URL (purl). The project has no
# canonical web address, so neither the producer nor the custom facets' schema names one: the schema
# is the file shipped in the package (schema.json beside this module), identified by its $id.
PRODUCER = f"pkg:generic/rlhf-pipeline@{__version__}"
RUN_EVENT_SCHEMA = "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunEvent"
# the version of each standard facet's published schema that the event follows
STANDARD_FACET_VERSIONS = {"SourceCodeJobFacet": "1-0-1", "SourceCodeLocationJobFacet": "1-1-0"}
STANDARD_FACETS = "https://openlineage.io/spec/facets/{version}/{name}.json#/$defs/{name}"
CUSTOM_FACETS_SCHEMA = "urn:rlhf-pipeline:openlineage:facets"  # schema.json's $id
CUSTOM_FACETS = CUSTOM_FACETS_SCHEMA + "#/$defs/{name}"


def facet(name: str, **fields: Any) -> dict[str, Any]:
    """A facet object: the spec's two base fields (a standard facet's schema, or ours), then ``fields``."""
    version = STANDARD_FACET_VERSIONS.get(name)
    schema = STANDARD_FACETS.format(version=version, name=name) if version else CUSTOM_FACETS.format(name=name)
    return {"_producer": PRODUCER, "_schemaURL": schema, **fields}


LOCAL_NAMESPACE = "dvc://local"
NAMESPACE_ENV = "OPENLINEAGE_NAMESPACE"  # the variable openlineage-python's client reads for the same purpose


def namespace_of(git: dict[str, Any], configured: str | None = None) -> str:
    """The project's OpenLineage namespace, the same in every clone: a configured name (``--namespace`` or
    $OPENLINEAGE_NAMESPACE), else one made from the git remote, else ``dvc://local``."""
    configured = configured or os.environ.get(NAMESPACE_ENV)
    if configured:
        return configured
    return record.remote_namespace(git["url"]) if git.get("url") else LOCAL_NAMESPACE


def build_lineage(path: str | os.PathLike, namespace: str | None = None, rev: str | None = None) -> dict[str, Any]:
    """The OpenLineage RunEvent for the stage run that produced ``path`` (``namespace``: see ``namespace_of``),
    as the workspace has it, or as git revision ``rev`` recorded it (nothing checked out)."""
    from dvc.lock import LockError

    repo, rel = record.open_repo(path, rev)
    if not list(repo.index.stages):
        raise PipelineError(
            f"{path} has no recorded lineage: there is no dvc.lock (nor any .dvc file) in {repo.root_dir}. "
            "Run `dvc repro` first so DVC records which stage produced what."
        )
    found = record.producer_of(repo, rel)
    if found is None:
        raise SettingsError(record.not_produced_message(repo, str(path), rel))
    if rev:  # git's tree at a commit: no workspace to lock
        return _event(repo, *found, rel, namespace)
    try:
        with repo.lock:  # DVC's stage status needs it; held only while reading
            return _event(repo, *found, rel, namespace)
    except LockError as error:
        raise PipelineError(
            f"{path}: DVC's lock is held by another dvc command ({error}); run `rlhf lineage` again when it finishes."
        ) from None


def _event(repo, stage, out, rel: str, configured_namespace: str | None) -> dict[str, Any]:
    name = record.stage_name(stage)
    recorded_in = record.record_file(stage)
    order = record.upstream_stages(repo, stage)
    params_files = sorted({record.repo_path(repo, d) for s in order for d in record.params_deps(s)})
    git = record.git_facts(record.project_root(repo), recorded_in, params_files, record.revision(repo))
    namespace = namespace_of(git, configured_namespace)
    job_facets = {"sourceCode": facet("SourceCodeJobFacet", language="shell", sourceCode=_command(repo, stage, out))}
    if git.get("url"):  # only a remote others can reach: a local checkout's path means nothing elsewhere
        location = {"url": git["url"], "repoUrl": git["url"], "path": recorded_in}
        location |= {"version": git["commit"]} if git.get("commit") else {}
        job_facets["sourceCodeLocation"] = facet("SourceCodeLocationJobFacet", type="git", **location)
    outputs = [_dataset(repo, o, stage, namespace, producedBy=name, metric=bool(o.metric)) for o in stage.outs]
    locked_outs = sorted(
        f"{record.repo_path(repo, o)}={o.hash_info.value if o.hash_info else None}" for o in stage.outs
    )
    event_time, dated_by = record.produced_at(stage)
    return {
        "eventType": "COMPLETE",
        "eventTime": event_time,
        "producer": PRODUCER,
        "schemaURL": RUN_EVENT_SCHEMA,
        "job": {
            "namespace": namespace,
            "name": name,
            "facets": job_facets,
        },
        "run": {
            # deterministic: the same stage run (the same locked outputs) always gets the same id
            "runId": str(uuid.uuid5(uuid.NAMESPACE_URL, f"{namespace}/{name}?outs={','.join(locked_outs)}")),
            "facets": _run_facets(repo, stage, order, {**_artifact(repo, out, rel), "datedBy": dated_by}, git),
        },
        "inputs": _inputs(repo, order, namespace),
        "outputs": outputs,
    }


def _command(repo, stage, out) -> str:
    return record.command(stage) or f"dvc add {record.repo_path(repo, out)}"


def _run_facets(repo, stage, order: list, artifact: dict, git: dict) -> dict[str, Any]:
    reports = [_stage_report(repo, s) for s in order]
    reasons = [f"{r['name']}: {reason}" for r in reports for reason in r["reasons"]]
    changed: dict[str, dict[str, Any]] = {}
    for item in order:
        for key, change in record.params_changed(repo, item).items():
            changed.setdefault(key, {**change, "stages": []})["stages"].append(record.stage_name(item))
    modified = artifact["status"] != "ok"
    metrics = [record.repo_path(repo, o) for o in stage.outs if o.metric]
    upstream = [record.repo_path(repo, o) for s in order[1:] for o in s.outs if o.metric]
    card_paths = [artifact["path"], artifact["output"], *(record.repo_path(repo, o) for o in stage.outs)]
    return {
        "artifact": facet("ArtifactRunFacet", **artifact),
        "parameters": facet("ParametersRunFacet", values=reports[0]["parameters"]),
        "upstreamParameters": facet(
            "UpstreamParametersRunFacet", stages={r["name"]: r["parameters"] for r in reports[1:] if r["parameters"]}
        ),
        "paramsDiff": facet("ParamsDiffRunFacet", changes=changed),
        "git": facet("GitRunFacet", **git),
        "environment": facet("EnvironmentRunFacet", **facts.environment(repo, card_paths)),
        "metrics": facet("MetricsRunFacet", files=facts.read_metrics(repo, metrics)),
        "upstreamMetrics": facet("MetricsRunFacet", files=facts.read_metrics(repo, upstream)),
        "stale": facet("StaleRunFacet", stale=modified or bool(reasons), artifactModified=modified, reasons=reasons),
        "dvcStages": facet("DvcStagesRunFacet", stages=reports),
    }


def _stage_report(repo, stage) -> dict[str, Any]:
    reasons = record.stage_reasons(repo, stage)
    return {
        "name": record.stage_name(stage),
        "kind": "dvcfile" if stage.is_data_source else "stage",
        "recordedIn": record.record_file(stage),
        "cmd": record.command(stage),
        "deps": [record.repo_path(repo, d) for d in record.file_deps(stage)],
        "outs": [record.repo_path(repo, o) for o in stage.outs],
        "parameters": record.params_used(repo, stage),
        "stale": bool(reasons),
        "reasons": reasons,
    }


def _artifact(repo, out, rel: str) -> dict[str, Any]:
    """The requested path: the whole output, or a file or folder inside one."""
    output = record.repo_path(repo, out)
    check = record.entry_check(repo, out) if rel == output else record.inner_file_check(repo, out, rel)
    hashes = {"lockedHash": check["locked"], "workspaceHash": check["workspace"], "status": check["status"]}
    return {"path": rel, "output": output, **hashes, **({"files": check["files"]} if check.get("files") else {})}


def _inputs(repo, order: list, namespace: str) -> list[dict[str, Any]]:
    """Every file dep of the stages in ``order``, with who produced and who read it."""
    readers: dict[str, tuple[Any, list[str]]] = {}
    for stage in order:
        for dep in record.file_deps(stage):
            readers.setdefault(record.repo_path(repo, dep), (dep, []))[1].append(record.stage_name(stage))
    datasets = []
    for path, (dep, names) in readers.items():
        found = record.producer_of(repo, path)
        producer = found[0] if found and not found[0].is_data_source else None
        tracker = {"trackedBy": record.stage_name(found[0])} if found and found[0].is_data_source else {}
        produced_by = record.stage_name(producer) if producer else None
        fields = {"producedBy": produced_by, "consumedBy": names, "source": not produced_by, **tracker}
        datasets.append(_dataset(repo, dep, producer, namespace, **fields))
    return datasets


def _dataset(repo, entry, producer, namespace: str, **dvc_fields: Any) -> dict[str, Any]:
    """An input or output: DVC's record of it, and what it says about itself."""
    path, check = record.repo_path(repo, entry), record.entry_check(repo, entry)
    meta = {"size": entry.meta.size, "nfiles": entry.meta.nfiles} if entry.meta else {"size": None, "nfiles": None}
    state = {"status": check["status"], "stale": check["status"] in ("modified", "missing")}
    files = {"files": check["files"]} if check.get("files") else {}
    dvc = facet("DvcEntryDatasetFacet", hash=check["locked"], **meta, **state, **dvc_fields, **files)
    notes = {
        k: facet(f"{k[0].upper()}{k[1:]}DatasetFacet", **v) for k, v in facts.annotate(repo, path, producer).items()
    }
    return {"namespace": namespace, "name": path, "facets": {"dvc": dvc, **notes}}
