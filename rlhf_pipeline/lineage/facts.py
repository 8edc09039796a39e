"""What the artifacts say about themselves: model cards (read with ``huggingface_hub.ModelCard``),
the preference data's size and contract verdict, the stage's metrics (read by DVC), the software
and the device."""

from __future__ import annotations

import json
import platform
import re
from importlib import metadata
from pathlib import Path
from typing import Any

from rlhf_pipeline.environment import compare, environment_record
from rlhf_pipeline.gitrepo import commits_touching, file_bytes_at
from rlhf_pipeline.lineage.record import is_under, project_root, read_text, repo_path, revision, stage_name
from rlhf_pipeline.modelcard import CARD
from rlhf_pipeline.paths import BASE_MODEL as BASE_MODEL_DIR
from rlhf_pipeline.paths import PREFERENCES as PREFERENCES_DIR
from rlhf_pipeline.paths import REQUIREMENTS_LOCK, VALIDATION_SUMMARY

PACKAGES = ("torch", "transformers", "datasets", "dvc", "prefect")
PREFERENCE_PROVENANCE = f"{PREFERENCES_DIR}/format.json"  # the stage's record of the labels' source and rounds
BASE_MODEL_KEYS = ("source", "source_sha256", "source_file", "base_model", "revision", "sequence_prefix")
MODEL_CARD_KEYS = ("base_model", "library_name", "device", "license", "task_mode", "chat_template_sha256")


def card_metadata(repo, path: str) -> tuple[str, dict] | None:
    """(the card's path, its metadata) when ``path`` is a model folder with a README.md card, or the
    card itself; read as ``repo`` sees it (the workspace, or DVC's cache at a revision)."""
    from huggingface_hub import ModelCard

    card = path if Path(path).name == CARD else f"{path.rstrip('/')}/{CARD}"
    text = read_text(repo, card)
    if not text or not text.startswith("---"):
        return None
    try:
        found = ModelCard(text).data.to_dict()
    except Exception:  # a damaged card must not hide the rest of the lineage
        return None
    return (card, found) if found else None


def read_metrics(repo, paths: list[str]) -> dict[str, Any]:
    """Each metrics file's values as DVC reads them, or ``{"error": ...}``."""
    # at a revision DVC resolves targets against the current directory: read them all, pick ours
    targets = None if revision(repo) else paths
    shown = repo.metrics.show(targets=targets).get("", {}).get("data", {}) if paths else {}
    return {p: shown.get(p, {}).get("data", {"error": str(shown.get(p, {}).get("error", "missing"))}) for p in paths}


def preference_facts(repo, metrics_files: list[str]) -> dict[str, Any]:
    """Rows (all splits: every ``rows`` or ``rows/SPLIT`` value in the stage's metrics, read by DVC),
    the Great Expectations verdict and, for human labels, which rows came from which round and model."""
    from dvc.utils.flatten import flatten

    rows, source = None, None
    for path, values in read_metrics(repo, metrics_files).items():
        if counts := [v for k, v in flatten(values).items() if re.split(r"[/.]", k)[0] == "rows" and type(v) is int]:
            rows, source = sum(counts), path
            break
    validation: dict[str, Any] = {"summary": VALIDATION_SUMMARY, "success": None}
    summary = read_text(repo, VALIDATION_SUMMARY)
    if summary is not None:
        try:
            verdict = json.loads(summary).get("success")
        except (ValueError, AttributeError):
            verdict = None
        validation["success"] = verdict if isinstance(verdict, bool) else None
    else:
        validation["note"] = "no validation summary"
    facts = {"rows": rows, "rowsSource": source, "validation": validation}
    try:
        provenance = json.loads(read_text(repo, PREFERENCE_PROVENANCE) or "{}")
    except ValueError:
        provenance = {}
    if isinstance(provenance, dict) and isinstance(provenance.get("rounds"), list):
        facts["rounds"] = provenance["rounds"]
    return facts


def annotate(repo, path: str, producer) -> dict[str, Any]:
    """Facts about known kinds of artifact: a base model's provenance, another model's card, preference data."""
    notes: dict[str, Any] = {}
    if card := card_metadata(repo, path):
        where, found = card
        is_base = "source" in found or "source_sha256" in found or path == BASE_MODEL_DIR
        keys = BASE_MODEL_KEYS if is_base else MODEL_CARD_KEYS
        notes["baseModel" if is_base else "modelCard"] = {
            "card": where,
            **{k: found[k] for k in keys if found.get(k) is not None},
        }
    if (producer is not None and stage_name(producer) == "preferences") or is_under(path, PREFERENCES_DIR):
        metrics = [repo_path(repo, out) for out in producer.outs if out.metric] if producer is not None else []
        notes["preferenceData"] = preference_facts(repo, metrics)
    return notes


def lock_texts(root: str) -> dict[str, str]:
    """``{sha256: text}`` of the workspace's lock and of every version git history holds of it."""
    import hashlib

    texts = {}
    blobs = [Path(root, REQUIREMENTS_LOCK).read_bytes()] if Path(root, REQUIREMENTS_LOCK).is_file() else []
    for commit in commits_touching(root, REQUIREMENTS_LOCK):
        if (shown := file_bytes_at(root, commit, REQUIREMENTS_LOCK)) is not None:
            blobs.append(shown)
    for blob in blobs:
        texts.setdefault(hashlib.sha256(blob).hexdigest(), blob.decode("utf-8", "replace"))
    return texts


def environment(repo, card_paths: list[str]) -> dict[str, Any]:
    """The running environment (package versions, the lock it is installed from) and the device;
    with the environment the artifact's model card records and how the two differ (``comparison``:
    ``same`` false means the running packages are not the ones that made the artifact)."""
    root = project_root(repo)
    env: dict[str, Any] = {}
    for package in PACKAGES:
        try:
            env[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            env[package] = "not installed"
    env["python"] = platform.python_version()
    running = environment_record(root)
    env["running"] = running
    cards = [card for card in (card_metadata(repo, path) for path in dict.fromkeys(card_paths)) if card]
    recorded = next((c[1].get("lineage", {}).get("environment") for c in cards if c[1].get("lineage")), None)
    env["recorded"] = recorded
    env["comparison"] = compare(recorded or {}, running, lock_texts(root))
    for card in cards:
        if card[1].get("device"):
            return {**env, "device": str(card[1]["device"]), "deviceSource": card[0]}
    if revision(repo):
        return {**env, "device": "unknown", "deviceSource": "no model card at that revision"}
    import torch

    return {
        **env,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "deviceSource": "current machine",
    }
