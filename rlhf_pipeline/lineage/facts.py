"""What the artifacts say about themselves: model cards (read with ``huggingface_hub.ModelCard``),
the preference data's size and contract verdict, the stage's metrics (read by DVC), the software
and the device."""

from __future__ import annotations

import json
import platform
import re
from pathlib import Path
from typing import Any

from rlhf_pipeline.lineage.record import is_under, repo_path, stage_name
from rlhf_pipeline.modelcard import CARD, read_card

PACKAGES = ("torch", "transformers", "datasets", "dvc", "prefect")
VALIDATION_SUMMARY = "data/validation/summary.json"
PREFERENCES_DIR = "data/preferences"
BASE_MODEL_DIR = "models/base"
BASE_MODEL_KEYS = ("source", "source_sha256", "source_file", "base_model", "revision")
MODEL_CARD_KEYS = ("base_model", "library_name", "device", "license", "task_mode", "chat_template_sha256")


def card_metadata(root: str, path: str) -> tuple[str, dict] | None:
    """(the card's path, its metadata) when ``path`` is a model folder with a README.md card, or the card itself."""
    target = Path(root, path)
    folder = target if target.is_dir() else target.parent if target.name == CARD else None
    if folder is None:
        return None
    try:
        metadata = read_card(folder)
    except Exception:  # a damaged card must not hide the rest of the lineage
        return None
    return ((folder / CARD).relative_to(root).as_posix(), metadata) if metadata else None


def read_metrics(repo, paths: list[str]) -> dict[str, Any]:
    """Each metrics file's values as DVC reads them, or ``{"error": ...}``."""
    if not paths:
        return {}
    shown = repo.metrics.show(targets=paths).get("", {}).get("data", {})
    return {
        path: shown.get(path, {}).get("data", {"error": str(shown.get(path, {}).get("error", "missing"))})
        for path in paths
    }


def preference_facts(repo, metrics_files: list[str]) -> dict[str, Any]:
    """Rows (all splits: every ``rows`` or ``rows/SPLIT`` value in the stage's metrics, read by DVC)
    and the Great Expectations verdict."""
    from dvc.utils.flatten import flatten

    rows, source = None, None
    for path, values in read_metrics(repo, metrics_files).items():
        counts = [v for k, v in flatten(values).items() if re.split(r"[/.]", k)[0] == "rows" and type(v) is int]
        if counts:
            rows, source = sum(counts), path
            break
    validation: dict[str, Any] = {"summary": VALIDATION_SUMMARY, "success": None}
    summary = Path(repo.root_dir, VALIDATION_SUMMARY)
    if summary.is_file():
        verdict = json.loads(summary.read_text()).get("success")
        validation["success"] = verdict if isinstance(verdict, bool) else None
    else:
        validation["note"] = "no validation summary"
    return {"rows": rows, "rowsSource": source, "validation": validation}


def annotate(repo, path: str, producer) -> dict[str, Any]:
    """Facts about known kinds of artifact: a base model's provenance, another model's card, preference data."""
    notes: dict[str, Any] = {}
    card = card_metadata(repo.root_dir, path)
    if card:
        where, metadata = card
        is_base = "source" in metadata or "source_sha256" in metadata or path == BASE_MODEL_DIR
        keys = BASE_MODEL_KEYS if is_base else MODEL_CARD_KEYS
        notes["baseModel" if is_base else "modelCard"] = {
            "card": where,
            **{k: metadata[k] for k in keys if metadata.get(k) is not None},
        }
    if (producer is not None and stage_name(producer) == "preferences") or is_under(path, PREFERENCES_DIR):
        metrics = [repo_path(repo, out) for out in producer.outs if out.metric] if producer is not None else []
        notes["preferenceData"] = preference_facts(repo, metrics)
    return notes


def environment(root: str, card_paths: list[str]) -> dict[str, Any]:
    """Package versions and the device: the one a model card records, else this machine's."""
    from importlib import metadata

    env: dict[str, Any] = {}
    for package in PACKAGES:
        try:
            env[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            env[package] = "not installed"
    env["python"] = platform.python_version()
    for path in card_paths:
        card = card_metadata(root, path)
        if card and card[1].get("device"):
            return {**env, "device": str(card[1]["device"]), "deviceSource": card[0]}
    return {**env, "device": _current_device(), "deviceSource": "current machine"}


def _current_device() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # no torch, or a broken CUDA set-up: the report still stands
        return "cpu"
