"""Model cards (README.md with YAML front matter) for every saved model directory.

The lineage section is computed when the model is written: the git commit of the code, a
content hash of each input, and the params that made it. ``rlhf lineage`` cross-checks the same
facts later from dvc.lock.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import yaml

from rlhf_pipeline.io import sha256_file
from rlhf_pipeline.models import write_model_card


def git_state() -> dict:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    sha = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no")) if sha else None
    return {"commit": sha or "unknown", "dirty": dirty}


def content_hash(path: str | os.PathLike) -> str:
    """sha256 over the sorted (relative path, file sha256) pairs of a file or directory."""
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(f"{file.relative_to(path)}\0{sha256_file(file)}\n".encode())
    return digest.hexdigest()


def write_card(
    directory: str | os.PathLike,
    title: str,
    summary: str,
    base_model: str,
    datasets: list[str],
    tags: list[str],
    hyperparameters: dict,
    metrics: dict,
    inputs: list[str],
    license: str = "apache-2.0",
    extra_front_matter: dict | None = None,
) -> None:
    import torch

    inputs_hashes = {str(p): content_hash(p) for p in inputs if Path(p).exists()}
    git = git_state()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    front = {
        "base_model": base_model,
        "datasets": datasets,
        "license": license,
        "library_name": "transformers",
        "tags": ["rlhf-pipeline", *tags],
        "device": device,
        "git_commit": git["commit"],
        "git_dirty": git["dirty"],
        **(extra_front_matter or {}),
    }
    body = [
        f"# {title}",
        "",
        summary.strip(),
        "",
        "## Training procedure and hyperparameters",
        "",
        "```yaml",
        yaml.safe_dump(hyperparameters, sort_keys=False).strip(),
        "```",
        "",
    ]
    body += ["## Evaluation", ""]
    body += [f"- `{k}`: {v:.4f}" if isinstance(v, float) else f"- `{k}`: {v}" for k, v in metrics.items()] or ["(none)"]
    body += [
        "",
        "## Lineage",
        "",
        f"- git commit: `{git['commit']}`" + (" (working tree dirty)" if git["dirty"] else ""),
        f"- device: {device}",
    ]
    body += [f"- input `{p}`: sha256 `{h}`" for p, h in inputs_hashes.items()]
    body += ["", "Full chain: `rlhf lineage " + str(directory) + "`."]
    write_model_card(directory, front, "\n".join(body))
