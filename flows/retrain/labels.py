"""The flow's label tasks: what a run adds to the labels before any stage runs.

One key says where the labels are: ``data.preferences.source``, the file the preferences stage
reads. ``labelling.source`` says how a run brings labels into it (see LabellingParams):
``simulated`` brings none (an ``--incoming`` file is refused), ``file`` ingests the run's
``--incoming`` file over it, ``label_studio`` appends a Label Studio project's new annotations to
it. Either way the bytes validated are the bytes that land, and the file is ``dvc add``-ed.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from prefect.tasks import exponential_backoff

from flows.retrain.defaults import RETRIES, RETRY_DELAY_SECONDS
from flows.retrain.dvc_project import (
    RetrainError,
    capture,
    dvc_command,
    is_stage_output,
    refuse_retry_on_contract_errors,
    run_rlhf,
)
from rlhf_pipeline.errors import DataContractError, ParamsError, PipelineError
from rlhf_pipeline.params.labelling import FILE_LABELS, LABEL_FILE_SUFFIXES, SIMULATED_LABELS
from rlhf_pipeline.params.schema import Params, load_params


class InvalidPreferences(RetrainError):
    """The incoming preference file failed validation; nothing was replaced."""


def _newest_preference_file(incoming: Path) -> Path:
    if incoming.is_file():
        return incoming
    if incoming.is_dir():
        candidates = [p for p in incoming.iterdir() if p.is_file() and p.suffix in LABEL_FILE_SUFFIXES]
        if candidates:
            return max(candidates, key=lambda p: (p.stat().st_mtime, p.name))
        raise RetrainError(f"no .jsonl or .parquet preference file in {incoming}", ParamsError.exit_code)
    raise RetrainError(f"incoming preference path {incoming} does not exist", ParamsError.exit_code)


@task(name="ingest-preferences", cache_policy=NO_CACHE)
def ingest_preferences(
    repo: str, incoming: str, target: str, validate_command: list[str], shown_as: str | None = None
) -> dict[str, Any]:
    """Copy the incoming file privately, validate that copy, then rename it over ``target`` (the
    labels file, relative to ``repo``) and ``dvc add`` it: the bytes checked are the bytes ingested,
    even while an exporter still writes. ``shown_as``: what messages call the incoming file (labels
    pulled into a scratch file)."""
    logger = get_run_logger()
    root = Path(repo).resolve()
    source = _newest_preference_file(Path(incoming).expanduser().resolve())
    destination = (root / target).resolve()
    if root not in destination.parents:
        raise RetrainError(f"data.preferences.source {target} is outside the repository {root}", ParamsError.exit_code)
    if source.suffix != destination.suffix:
        raise RetrainError(
            f"incoming preference file {source} is {source.suffix} but data.preferences.source {target} is "
            f"{destination.suffix}: pass a file of the same format, or change data.preferences.source",
            ParamsError.exit_code,
        )
    destination.parent.mkdir(parents=True, exist_ok=True)
    # the private copy keeps the suffix (the validator reads the format from it) and sits beside the
    # target, so that putting it in place is one rename on one file system
    fd, name = tempfile.mkstemp(prefix=f".{destination.name}.", suffix=destination.suffix, dir=destination.parent)
    private = Path(name)
    try:
        with os.fdopen(fd, "wb") as out, source.open("rb") as src:
            shutil.copyfileobj(src, out)
            out.flush()
            os.fsync(out.fileno())
        logger.info("validating %s (a private copy of %s)", private.name, source)
        check = capture([*validate_command, str(private)], root, timeout=3600)
        if check.returncode != 0:
            summary = "\n".join(part.strip() for part in (check.output, check.stderr) if part.strip())
            shown = shown_as or str(source)
            raise InvalidPreferences(
                f"incoming preference file {shown} failed validation (exit {check.returncode}); "
                f"nothing was replaced.\n{summary.replace(str(private), shown)}",
                exit_code=DataContractError.exit_code
                if check.returncode == DataContractError.exit_code
                else PipelineError.exit_code,
            )
        unchanged = destination.is_file() and filecmp.cmp(private, destination, shallow=False)
        if not unchanged:
            os.replace(private, destination)
            logger.info("copied %s -> %s (the validated bytes)", source, destination)
    finally:
        private.unlink(missing_ok=True)
    return {
        "source": str(source),
        "target": target,
        "changed": not unchanged,
        "tracked": _track(root, destination, unchanged),
    }


def _track(root: Path, labels: Path, unchanged: bool) -> str:
    """``dvc add`` the labels file (unless a stage makes it, or it is unchanged and already added)."""
    if is_stage_output(root, labels):
        return "stage output (not dvc-added)"
    dvc_file = labels.with_name(labels.name + ".dvc")
    if unchanged and dvc_file.is_file():
        return f"unchanged ({dvc_file.name})"
    added = capture(dvc_command("add", str(labels.relative_to(root))), root)
    if added.returncode != 0:
        raise RetrainError(
            f"dvc add {labels.relative_to(root)} failed (exit {added.returncode}):\n"
            f"{added.stderr.strip() or added.output.strip()}"
        )
    return f"dvc add -> {dvc_file.name}"


@task(
    name="pull-labels",
    retries=RETRIES,
    retry_delay_seconds=exponential_backoff(RETRY_DELAY_SECONDS),
    retry_condition_fn=refuse_retry_on_contract_errors,
    cache_policy=NO_CACHE,
)
def pull_labels(repo: str, project: int, labels_file: str, private: str) -> dict[str, Any]:
    """Label Studio ``project``'s annotations (``rlhf label import --from-server``: address and token
    from this process's environment) added to a private copy of ``labels_file``, every earlier
    round kept; the copy is then validated and ingested like any incoming file."""
    root = Path(repo)
    current = root / labels_file
    if current.is_file():
        shutil.copyfile(current, private)
    else:
        Path(private).unlink(missing_ok=True)
    pulled = run_rlhf(
        root,
        ["label", "import", "--from-server", str(project), private, "--append"],
        f"pulling labels from Label Studio project {project}",
        unchanged=f"{labels_file} is unchanged",
    )
    return json.loads(pulled)


def bring_in_labels(
    root: Path,
    incoming: str | None,
    validate_command: list[str],
    retries: int = RETRIES,
    retry_delay_seconds: float = RETRY_DELAY_SECONDS,
) -> dict:
    """What ``labelling.source`` in params.yaml (the schema's defaults without one) says this run
    adds to the labels file ``data.preferences.source``: {"ingested": ..., "pulled": ...}. A pull that
    fails for a reason a retry can fix (the server restarting) is retried like a stage."""
    params = load_params(root / "params.yaml") if (root / "params.yaml").is_file() else Params()
    labelling, labels_file = params.labelling, params.data.preferences.source
    if labelling.source == SIMULATED_LABELS:
        if incoming:
            raise RetrainError(
                "labelling.source is simulated (params.yaml, or the default without one): this project's labels "
                f"are data.preferences.source ({labels_file}) as it stands, and a run brings in none, so the incoming "
                f"file {incoming} would be left out. To train on files of labels, set labelling.source: file and "
                "data.preferences.source: the .jsonl or .parquet file (e.g. data/labels/human.jsonl) each --incoming "
                "file replaces. "
                "Nothing was changed.",
                ParamsError.exit_code,
            )
        return {}
    if labelling.source == FILE_LABELS:
        if not incoming:
            return {"ingested": None, "note": "labelling.source is file and no --incoming file was given"}
        return {"ingested": ingest_preferences(str(root), incoming, labels_file, validate_command)}
    if incoming:
        raise RetrainError(
            f"labelling.source is label_studio in params.yaml: the run pulls its labels from Label Studio project "
            f"{labelling.label_studio_project}, so the incoming file {incoming} would be left out; pass no incoming "
            "file, or set labelling.source: file. Nothing was changed.",
            ParamsError.exit_code,
        )
    target = root / labels_file
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, private = tempfile.mkstemp(prefix=f".{target.name}.pull-", suffix=target.suffix, dir=target.parent)
    os.close(fd)
    try:
        project = labelling.label_studio_project
        pull = pull_labels.with_options(retries=retries, retry_delay_seconds=exponential_backoff(retry_delay_seconds))
        pulled = pull(str(root), project, labels_file, private)
        shown = f"{labels_file} with Label Studio project {project}'s new labels"
        return {
            "pulled": pulled,
            "ingested": ingest_preferences(str(root), private, labels_file, validate_command, shown),
        }
    finally:
        Path(private).unlink(missing_ok=True)
