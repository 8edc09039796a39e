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
    try:
        found = read_card(folder) if folder is not None else None
    except Exception:  # a damaged card must not hide the rest of the lineage
        return None
    return ((folder / CARD).relative_to(root).as_posix(), found) if found else None


def read_metrics(repo, paths: list[str]) -> dict[str, Any]:
    """Each metrics file's values as DVC reads them, or ``{"error": ...}``."""
    shown = repo.metrics.show(targets=paths).get("", {}).get("data", {}) if paths else {}
    return {p: shown.get(p, {}).get("data", {"error": str(shown.get(p, {}).get("error", "missing"))}) for p in paths}


def preference_facts(repo, metrics_files: list[str]) -> dict[str, Any]:
    """Rows (all splits: every ``rows`` or ``rows/SPLIT`` value in the stage's metrics, read by DVC)
    and the Great Expectations verdict."""
    from dvc.utils.flatten import flatten

    rows, source = None, None
    for path, values in read_metrics(repo, metrics_files).items():
        if counts := [v for k, v in flatten(values).items() if re.split(r"[/.]", k)[0] == "rows" and type(v) is int]:
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
    if card := card_metadata(repo.root_dir, path):
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


def environment(root: str, card_paths: list[str]) -> dict[str, Any]:
    """Package versions and the device: the one a model card records, else this machine's."""
    env: dict[str, Any] = {}
    for package in PACKAGES:
        try:
            env[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            env[package] = "not installed"
    env["python"] = platform.python_version()
    for card in filter(None, (card_metadata(root, path) for path in card_paths)):
        if card[1].get("device"):
            return {**env, "device": str(card[1]["device"]), "deviceSource": card[0]}
    import torch

    return {
        **env,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "deviceSource": "current machine",
    }
