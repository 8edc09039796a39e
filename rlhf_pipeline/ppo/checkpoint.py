"""Resumable PPO checkpoints: the training state (weights, optimizer, KL controller, torch's random
generators, the statistics so far) and a snapshot of the trained weights at each checkpoint."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from safetensors.torch import save as save_safetensors
from torch import Tensor

from rlhf_pipeline.errors import DamagedArtifactError, NonFiniteError, PipelineError
from rlhf_pipeline.functional import non_finite_tensors
from rlhf_pipeline.io import (
    CHECKSUMS,
    atomic_dir,
    atomic_file,
    checksum_problems,
    checksum_text,
    read_checksums,
    recover_interrupted_write,
    sha256_file,
)

SNAPSHOT_GLOB = "update_*.safetensors"  # the one naming of snapshots: snapshot_name writes it, snapshot_update reads it


def snapshot_name(update: int) -> str:
    """The file name of the snapshot taken after PPO update ``update``: ``update_00012.safetensors``."""
    return f"update_{update:05d}.safetensors"


def snapshot_update(path: str | Path) -> int:
    """The PPO update a snapshot file holds, from its name (the inverse of :func:`snapshot_name`)."""
    return int(Path(path).name.removeprefix("update_").removesuffix(".safetensors"))


def rng_state() -> dict:
    """torch's process-wide generators (CPU, and each CUDA device's), the ones model code draws from
    (dropout), as tensors only, so that the checkpoint loads with ``torch.load(weights_only=True)``:
    no pickle, no code run from a shared cache.

    Python's and numpy's process-wide generators are not saved: the trainer draws nothing from them
    (its every draw comes from a ``torch.Generator`` seeded by seed and update), while other code in
    the process may (the threads a Prefect flow leaves running draw jitter from ``random``: two
    identical runs in one pytest worker wrote different checkpoints), so saving them made a
    checkpoint's bytes depend on what else ran, and restoring them would rewind that code's draws."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Put back what :func:`rng_state` saved (a checkpoint from before it dropped Python's and numpy's
    generators still loads: those entries are left alone)."""
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointer:
    """``state/`` holds everything to resume (atomic: temp dir, then rename; its ``meta.json``
    records each file's sha256); ``snapshots/`` keeps the trainable weights at each checkpoint for
    the over-optimisation curve, each file's sha256 in ``snapshots/SHA256SUMS``."""

    def __init__(self, directory: str | Path, fingerprint: str):
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.state_dir = self.directory / "state"
        self.snapshots = self.directory / "snapshots"

    STATE_FILES = ("trainable.safetensors", "training_state.pt", "history.json")

    def prepare(self) -> bool:
        """True if a resumable state with the same fingerprint exists and its files match the
        checksums in its meta.json; else start clean (with a warning when it was damaged)."""
        recover_interrupted_write(self.state_dir)
        for leftover in self.snapshots.glob(".update_*.tmp-*"):  # a snapshot write that was killed
            leftover.unlink()
        problem = self._damage()
        if problem is None:
            return True
        if problem:  # damaged: kept for a post-mortem, beside the output (DVC does not track it)
            aside = self._set_aside()
            print(
                f"train_policy: warning: the checkpoint in {self.state_dir} is unusable ({problem}); it was moved "
                f"to {aside} (delete it when you no longer need it) and training starts again from update 0.",
                file=sys.stderr,
            )
        elif self.directory.exists():  # another run's (other params or code): nothing to resume
            shutil.rmtree(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        return False

    def _set_aside(self) -> Path:
        """Move the damaged checkpoint folder to the first free ``<name>.damaged-N`` beside it."""
        number = 1
        while (aside := self.directory.with_name(f"{self.directory.name}.damaged-{number}")).exists():
            number += 1
        os.replace(self.directory, aside)
        return aside

    def _damage(self) -> str | None:
        """None if the state can be resumed; '' if there is none (or of other params); else what is wrong."""
        meta_path = self.state_dir / "meta.json"
        if not meta_path.is_file():
            return ""
        try:
            meta = json.loads(meta_path.read_text())
        except (ValueError, UnicodeDecodeError):
            return "meta.json is not valid JSON"
        if not isinstance(meta, dict) or meta.get("fingerprint") != self.fingerprint:
            return ""
        checksums = meta.get("sha256", {})
        for name in self.STATE_FILES:
            path = self.state_dir / name
            if not path.is_file():
                return f"{name} is missing"
            if checksums.get(name) != sha256_file(path):
                return f"{name} does not match the checksum in meta.json"
        return snapshot_problem(self.snapshots)

    def save(
        self,
        update: int,
        weights: dict[str, Tensor],
        snapshot: dict[str, Tensor],
        optimizer_state: dict,
        kl_state: dict,
        rng: list,
        history: list,
        budget: dict | None = None,
    ) -> None:
        """Write the state of update ``update``: the trainable weights and the optimizer state (both
        whole, keyed by parameter name, as :mod:`rlhf_pipeline.distributed` gathers them), the KL
        controller, each process's torch random generators, and the statistics so far; and ``snapshot``,
        the LM weights training changed (``lm.<name>``, named as in the base model) for the
        over-optimisation curve; ``budget``: the state of ``ppo.kl.budget`` (see the trainer)."""
        bad = non_finite_tensors(weights)
        if bad:  # never replace a good checkpoint with a broken one
            raise NonFiniteError(
                f"The weights after update {update} are not finite ({', '.join(bad[:3])}...). {self.last_good()}"
            )
        path = self.snapshots / snapshot_name(update)
        with atomic_file(path, "wb") as handle:
            handle.write(save_safetensors(snapshot))
        sums_path = self.snapshots / CHECKSUMS
        sums = {**(read_checksums(sums_path) if sums_path.is_file() else {}), path.name: sha256_file(path)}
        with atomic_file(sums_path) as handle:
            handle.write(checksum_text(sums))
        with atomic_dir(self.state_dir) as tmp:
            save_file(weights, str(tmp / "trainable.safetensors"))
            with open(tmp / "training_state.pt", "wb") as handle:  # a handle: a full disk then surfaces as an OSError
                torch.save({"optimizer": optimizer_state, "kl": kl_state, "rng": rng, "budget": budget}, handle)
            (tmp / "history.json").write_text(json.dumps(history))
            checksums = {name: sha256_file(tmp / name) for name in self.STATE_FILES}
            (tmp / "meta.json").write_text(
                json.dumps({"fingerprint": self.fingerprint, "update": update, "sha256": checksums})
            )

    def discard_snapshots_after(self, update: int) -> None:
        """Delete the snapshots of updates after ``update`` (a policy the KL budget rolled back), each file
        before its checksum line, so that a kill in between leaves no snapshot without its checksum."""
        later = [path for path in self.snapshots.glob(SNAPSHOT_GLOB) if snapshot_update(path) > update]
        if not later:
            return
        for path in later:
            path.unlink()
        sums_path = self.snapshots / CHECKSUMS
        sums = {name: digest for name, digest in read_checksums(sums_path).items() if (self.snapshots / name).is_file()}
        with atomic_file(sums_path) as handle:
            handle.write(checksum_text(sums))

    def last_good(self) -> str:
        """What the user still has after a failure, said as it is."""
        meta = self.state_dir / "meta.json"
        if meta.is_file():
            update = json.loads(meta.read_text()).get("update")
            return (
                f"Nothing was written; the last good checkpoint (update {update}, {self.state_dir}) is kept, "
                "and `dvc repro` resumes from it once the cause is fixed."
            )
        return "Nothing was written, and no checkpoint exists yet: the next run starts from update 0."

    def read(self, trainable_names: set[str]) -> dict:
        """What :meth:`save` wrote: weights, optimizer, kl, rng, budget, update, history."""
        weights = load_file(str(self.state_dir / "trainable.safetensors"))
        missing = trainable_names - set(weights)
        if missing:
            raise PipelineError(
                f"Checkpoint {self.state_dir} lacks weights {sorted(missing)[:3]}...; delete {self.directory} to "
                "start over."
            )
        state = torch.load(self.state_dir / "training_state.pt", weights_only=True)
        meta = json.loads((self.state_dir / "meta.json").read_text())
        history = json.loads((self.state_dir / "history.json").read_text())
        return {"weights": weights, **state, "update": meta["update"], "history": history}


def snapshot_problem(directory: str | Path) -> str | None:
    """What is wrong with the snapshots in ``directory`` (one unlisted in its SHA256SUMS, or whose
    bytes differ from the recorded sha256), or None when every one checks out."""
    directory = Path(directory)
    snapshots = sorted(p.name for p in directory.glob(SNAPSHOT_GLOB))
    if not snapshots:
        return None
    sums_path = directory / CHECKSUMS
    if not sums_path.is_file():
        return f"{sums_path} is missing"
    try:
        recorded = read_checksums(sums_path)
    except DamagedArtifactError as error:
        return str(error)
    unlisted = [name for name in snapshots if name not in recorded]
    problems = [f"{name} is not in {CHECKSUMS}" for name in unlisted]
    problems += checksum_problems(directory, {name: recorded[name] for name in snapshots if name in recorded})
    return "; ".join(f"snapshots/{p}" for p in problems) or None


def verified_snapshots(directory: str | Path) -> list[Path]:
    """The snapshots of ``directory`` in update order, each checked against the sha256 recorded when
    it was written; :class:`DamagedArtifactError` (nothing evaluated, nothing recorded) otherwise."""
    problem = snapshot_problem(directory)
    if problem:
        raise DamagedArtifactError(
            f"a checkpoint snapshot is damaged: {problem}. It is not used. `dvc checkout --force "
            f"{Path(directory).parent}` restores the checkpoints from the DVC cache if it holds a good copy; "
            f"otherwise delete {Path(directory).parent} and run `dvc repro --force train_policy`."
        )
    return sorted(Path(directory).glob(SNAPSHOT_GLOB))


def fingerprint_of(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
