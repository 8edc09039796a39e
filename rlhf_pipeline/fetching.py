"""A registered version's exact bytes, fetched through DVC and checked before anyone reads them
(`rlhf models get`, the gate's registered judge, a side-by-side round's models)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from rlhf_pipeline import metric_keys as keys
from rlhf_pipeline import paths
from rlhf_pipeline.errors import DamagedArtifactError, PipelineError
from rlhf_pipeline.gitrepo import file_at
from rlhf_pipeline.io import CHECKSUMS, checksum_problems, read_checksums, write_checksums
from rlhf_pipeline.lineage.verify import tree_md5
from rlhf_pipeline.modelcard import add_held_out_results, held_out_result
from rlhf_pipeline.registry import POLICY, Version, recorded_hash, resolve


def fetch(
    root: str | Path,
    name: str,
    version: str | None,
    stage: str | None,
    out: str | Path,
    with_results: bool | None = None,
) -> dict[str, Any]:
    """A version's bytes through ``dvc artifacts get`` (DVC's cache or remote at the version's
    commit), checked file by file against its ``SHA256SUMS`` before they replace ``out``.

    The policy's card was written before the evaluate stage measured it: the card a user gets gains
    the version's held-out results (gold and proxy gain, KL, win rate) in its text and as its
    ``model-index`` (:func:`held_out_results`), and ``SHA256SUMS`` the card's new hash.
    ``with_results``: None, when its commit has them; True, or fail; False, never (the bytes exactly
    as dvc.lock records them)."""
    from dvc.repo.artifacts import Artifacts  # loads DVC's repo: only when fetching

    root = Path(root).resolve()
    if with_results and name != POLICY:
        raise PipelineError(
            f"--with-results adds the evaluate stage's results to the policy's card; {name}'s card already holds "
            "its held-out results (its stage wrote them). Fetch it without --with-results."
        )
    target = resolve(root, f"{name}#{stage}" if stage else f"{name}@{version or 'latest'}")
    out = Path(out)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.get-", dir=out.parent if out.parent.exists() else None))
    try:
        Artifacts.get(str(root), name, version=target.version, out=str(staging / "artifact"))
        fetched = staging / "artifact"
        recorded, found = recorded_hash(root, target), tree_md5(fetched)
        if found != recorded:  # DVC checks out its cache without re-reading it: a swapped object passes there
            raise DamagedArtifactError(
                f"{target.tag} as fetched is not what dvc.lock at its commit {target.commit[:12]} records: its files "
                f"digest to {found}, the lock records {recorded}. The DVC cache or remote holds other bytes under "
                "that hash; `rlhf lineage --verify` finds which. Nothing was written."
            )
        if not (fetched / CHECKSUMS).is_file():
            raise DamagedArtifactError(f"{target.tag} as fetched has no {CHECKSUMS}: its bytes cannot be checked.")
        problems = checksum_problems(fetched, read_checksums(fetched / CHECKSUMS))
        if problems:
            raise DamagedArtifactError(
                f"{target.tag} as fetched does not match its {CHECKSUMS}: {'; '.join(problems[:5])}"
            )
        wanted = name == POLICY and with_results is not False
        results = held_out_results(root, target, required=bool(with_results)) if wanted else []
        if results:
            add_held_out_results(
                fetched, results, f"`{paths.EVALUATION_METRICS}` at commit {target.commit[:12]} ({target.tag})"
            )
            write_checksums(fetched)  # the files were checked above; the card is the one that changed
        if out.exists():
            raise PipelineError(f"{out} exists: choose a new folder (nothing was written).")
        shutil.move(str(fetched), str(out))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    files = len(read_checksums(out / CHECKSUMS))
    return {
        "artifact": name,
        "version": target.version,
        "commit": target.commit,
        "out": str(out),
        "files_checked": files,
        "results": bool(results),
    }


# the policy's held-out results, as the evaluate stage measured them: (metric, name, type), in base-model stds
HELD_OUT_POLICY_RESULTS = (
    (keys.GOLD_GAIN, "gold reward gain over the base model (base-model stds)", "gold_gain"),
    (keys.PROXY_GAIN, "reward-model score gain over the base model (base-model stds)", "proxy_gain"),
    (keys.KL, "KL from the base model (nats per response)", "kl"),
    (keys.KL_EXACT, "KL from the base model, exact over the vocabulary (nats per response)", "kl_exact"),
    (keys.WIN_RATE_GOLD, "win rate against the base model (gold judge)", "win_rate"),
)


def held_out_results(root: str | Path, target: Version, required: bool = True) -> list:
    """The ``model-index`` entries of ``target``: what the evaluate stage measured on held-out queries at its
    commit (none there: [], or a PipelineError when ``required``)."""
    text = file_at(root, target.commit, paths.EVALUATION_METRICS)
    measured = json.loads(text) if text else {}
    results = [
        held_out_result(label, measured[key], "held-out queries", metric_type, task="text-generation")
        for key, label, metric_type in HELD_OUT_POLICY_RESULTS
        if isinstance(measured.get(key), (int, float))
    ]
    if not results and required:
        raise PipelineError(
            f"{target.tag}: its commit {target.commit[:12]} records no held-out results in {paths.EVALUATION_METRICS} "
            "(the evaluate stage had not run): nothing was written. Fetch it without --with-results."
        )
    return results
