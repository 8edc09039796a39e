"""The model registry: versions and stages of the artifacts ``dvc.yaml`` declares (its
``artifacts:`` section), kept as GTO's annotated git tags (``policy@v2.0.0`` registers a version,
``policy#prod#3`` assigns a stage), the convention ``gto show`` and ``dvc artifacts get`` read.

A version is a git commit whose ``dvc.lock`` records the artifact's hash: :func:`register` tags
HEAD only when that hash differs from every registered version's, so a retrain that changed
nothing makes no version. What a version's metrics were, and its bytes, are read at its commit
(git for the metrics files, DVC's cache or remote for the bytes), never from the workspace.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rlhf_pipeline import metric_keys as keys
from rlhf_pipeline.errors import PipelineError, SettingsError, quoted
from rlhf_pipeline.file_lock import held
from rlhf_pipeline.gitrepo import file_at, git, resolve_rev
from rlhf_pipeline.paths import EVALUATION_METRICS, REWARD_TRAIN_METRICS, RUN_RECORD

PROD = "prod"
# the artifacts dvc.yaml declares (its `artifacts:` section) that the gate registers and promotes
POLICY, REWARD_MODEL = "policy", "reward-model"
# the metrics a version is listed with: (file, key, label)
VERSION_METRICS = (
    (EVALUATION_METRICS, keys.GOLD_GAIN, "gold gain"),
    (EVALUATION_METRICS, keys.GOLD_GAIN_SE, "gold SE"),
    (EVALUATION_METRICS, keys.PROXY_GAIN, "proxy gain"),
    (EVALUATION_METRICS, keys.PROXY_GAIN_SE, "proxy SE"),
    (EVALUATION_METRICS, keys.KL, "KL"),
    (REWARD_TRAIN_METRICS, keys.RM_ACCURACY, "RM accuracy"),
)
# a stage's name as GTO accepts it, narrowed to what a tag and a shell carry plainly: 2 to 64 of a-z, 0-9, -
STAGE_NAME = r"[a-z0-9][a-z0-9-]{0,62}[a-z0-9]"
_SPEC = re.compile(
    rf"^(?P<name>[a-z0-9][a-z0-9-]*)(?:@(?P<version>v?\d+(?:\.\d+){{0,2}}|latest)|#(?P<stage>{STAGE_NAME}))$"
)
_SEMVER = re.compile(r"v\d+\.\d+\.\d+")


@dataclass(frozen=True)
class Version:
    """One registered version of an artifact."""

    artifact: str
    version: str  # semver with a leading v, as GTO writes it: v2.0.0
    commit: str  # the git commit whose dvc.lock records the version's bytes
    created_at: str  # when it was registered (ISO 8601)
    stages: tuple[str, ...] = field(default=())  # stages assigned to it now

    @property
    def tag(self) -> str:
        return f"{self.artifact}@{self.version}"


def declared_artifacts(root: str | Path) -> dict[str, dict[str, Any]]:
    """``{name: {"path", "type", "desc", "labels"}}`` from the ``artifacts:`` section of ``root``/dvc.yaml."""
    path = Path(root, "dvc.yaml")
    if not path.is_file():
        return {}
    return dict((yaml.safe_load(path.read_text()) or {}).get("artifacts") or {})


def artifact_path(root: str | Path, name: str) -> str:
    artifacts = declared_artifacts(root)
    if name not in artifacts:
        known = ", ".join(sorted(artifacts)) or "none"
        raise SettingsError(f"dvc.yaml declares no artifact {quoted(name)} (its artifacts: {known}).")
    return str(artifacts[name]["path"]).rstrip("/")


def locked_hash(lock_text: str | None, path: str) -> str | None:
    """The hash ``dvc.lock`` (its text) records for the output ``path``; None when it records none."""
    if not lock_text:
        return None
    for stage in (yaml.safe_load(lock_text) or {}).get("stages", {}).values():
        for out in stage.get("outs", []):
            if str(out.get("path", "")).rstrip("/") == path:
                return out.get("md5")
    return None


def _gto():
    import gto.api  # GTO reads the tags through scmrepo: only when the registry is asked

    return gto.api


def versions(root: str | Path, name: str) -> list[Version]:
    """Every registered version of ``name``, newest (highest) first, with the stages assigned to it."""
    from gto.exceptions import ArtifactNotFound
    from semver import Version as SemVer

    artifact_path(root, name)
    try:
        shown = _gto().show(str(root), name, versions_per_stage=1)  # a stage marks its current holder only
    except ArtifactNotFound:  # GTO's word for "declared, but no version registered yet"
        return []
    found = []
    for item in shown:
        if not _SEMVER.fullmatch(str(item.get("version"))):
            continue  # a stage tag on a commit that has no version tag (any longer): see dangling_stages
        stages = tuple(sorted(s["stage"] for s in item.get("stages", []) if s.get("is_active", True)))
        created = item.get("created_at")
        found.append(
            Version(
                artifact=name,
                version=item["version"],
                commit=item["commit_hexsha"],
                created_at=created.isoformat() if hasattr(created, "isoformat") else str(created),
                stages=stages,
            )
        )
    return sorted(found, key=lambda v: SemVer.parse(v.version.lstrip("v")), reverse=True)


def dangling_stages(root: str | Path, name: str) -> list[dict[str, str]]:
    """The stages of ``name`` whose latest assignment points at a commit with no version tag (the
    version's tag was deleted after the stage was assigned): ``{"stage", "tag", "commit"}`` each."""
    from gto.exceptions import ArtifactNotFound

    artifact_path(root, name)
    try:
        shown = _gto().show(str(root), name, versions_per_stage=1)
    except ArtifactNotFound:
        return []
    found = {  # GTO lists such a commit once per ref that reaches it: one entry per stage
        (stage["stage"], item["commit_hexsha"]): {
            "stage": stage["stage"],
            "tag": str(stage.get("ref", "")),
            "commit": item["commit_hexsha"],
        }
        for item in shown
        if not _SEMVER.fullmatch(str(item.get("version")))
        for stage in item.get("stages", [])
        if stage.get("is_active", True)
    }
    return list(found.values())


def _dangling(name: str, stage: str, commit: str) -> SettingsError:
    return SettingsError(
        f"{name}#{stage} is a dangling stage tag: it points at commit {commit[:12]}, whose version tag is gone "
        "(deleted after the stage was assigned), so it names no version. Assign the stage to a registered version "
        f"(`rlhf models assign {name} VERSION --stage {stage}`; `rlhf models` lists them), or delete the stage's tags "
        f"(`git tag -l '{name}#{stage}#*'`). Nothing was read or written."
    )


def check_stage_name(stage: str) -> str:
    """``stage`` when it is a stage's name (:data:`STAGE_NAME`); else SettingsError (exit 2), before GTO sees it."""
    if not (isinstance(stage, str) and re.fullmatch(STAGE_NAME, stage)):
        raise SettingsError(
            f"{quoted(str(stage))} is not a stage's name: 2 to 64 lower-case letters, digits and '-', starting and "
            "ending with a letter or digit (prod, staging). Nothing was assigned."
        )
    return stage


def recorded_hash(root: str | Path, version: Version) -> str | None:
    """The hash of ``version``'s artifact that its commit's dvc.lock records; None when it records none."""
    return locked_hash(file_at(root, version.commit, "dvc.lock"), artifact_path(root, version.artifact))


def require_recorded(root: str | Path, version: Version) -> Version:
    """``version`` when its commit's dvc.lock records its artifact; else SettingsError (exit 2): a tag
    that names no bytes (pushed by hand onto a commit without a run) is not a version."""
    if recorded_hash(root, version) is None:
        path = artifact_path(root, version.artifact)
        raise SettingsError(
            f"{version.tag} is a tag on commit {version.commit[:12]}, whose dvc.lock records no {path}: it names no "
            f"model, so it is not a version (a tag pushed by hand?). Remove it (`git tag -d {version.tag}` and, "
            "where it was pushed, `git push --delete origin` the tag), or register a run with `rlhf models gate`."
        )
    return version


def in_stage(root: str | Path, name: str, stage: str = PROD) -> Version | None:
    """The version of ``name`` assigned ``stage`` now: the latest assignment wins (as ``gto show NAME#STAGE``)."""
    from gto.exceptions import ArtifactNotFound

    try:
        shown = _gto().show(str(root), f"{name}#{stage}")
    except ArtifactNotFound:
        return None
    if not shown:
        return None
    found = next((v for v in versions(root, name) if v.version == shown[0]["version"]), None)
    if found is None:
        raise _dangling(name, stage, shown[0]["commit_hexsha"])
    return require_recorded(root, found)


def normalise_version(version: str) -> str:
    """``2``, ``v2``, ``v2.1`` -> GTO's ``v2.0.0``, ``v2.1.0``."""
    parts = version.lstrip("v").split(".")
    if not all(p.isdigit() for p in parts) or len(parts) > 3:
        raise SettingsError(f"{quoted(version)} is not a version such as v2 or v2.0.0.")
    return "v" + ".".join([*parts, "0", "0"][:3])


def resolve(root: str | Path, spec: str) -> Version:
    """The version ``spec`` names: ``policy@v2`` (or ``@v2.0.0``), ``policy@latest``, ``policy#prod``."""
    match = _SPEC.match(spec) if len(spec) <= 256 else None
    if not match:
        raise SettingsError(
            f"{quoted(spec)} names no registry version: write NAME@VERSION (policy@v2), NAME@latest or "
            "NAME#STAGE (policy#prod)."
        )
    name, version, stage = match["name"], match["version"], match["stage"]
    registered = versions(root, name)
    if stage:
        found = in_stage(root, name, stage)
        if found is None:
            raise SettingsError(f"no version of {name} is assigned {stage!r}; `rlhf models` lists the versions.")
        return found
    if version == "latest":
        if not registered:
            raise PipelineError(
                f"{name} has no registered version yet; `rlhf models gate` registers HEAD's policy and the "
                "reward model it was trained against."
            )
        return require_recorded(root, registered[0])
    wanted = normalise_version(version)
    found = next((v for v in registered if v.version == wanted), None)
    if found is None:
        listed = ", ".join(v.version for v in registered) or "none"
        raise SettingsError(f"{name} has no version {wanted} (registered: {listed}).")
    return require_recorded(root, found)


def version_of(root: str | Path, name: str, ref: str = "HEAD") -> tuple[Version | None, str, str]:
    """``(version, commit, hash)``: the registered version of ``name`` whose bytes ``ref``'s dvc.lock
    records (None when none has them), ``ref``'s commit, and that hash."""
    path = artifact_path(root, name)
    commit = resolve_rev(root, ref, "revision")
    recorded = locked_hash(file_at(root, commit, "dvc.lock"), path)
    if recorded is None:
        raise PipelineError(
            f"dvc.lock at {commit[:12]} records no {path}: run `dvc repro` and commit dvc.lock before "
            f"registering {name}."
        )
    same = (v for v in versions(root, name) if recorded_hash(root, v) == recorded)
    return next(same, None), commit, recorded


@contextmanager
def registry_lock(root: str | Path) -> Iterator[None]:
    """One writer of the registry's tags at a time: GTO numbers a new tag from the ones it reads, so two
    at once would pick the same number (the second ``git tag`` fails) or race for ``prod``."""
    with held(Path(root, ".git", "rlhf-registry")):
        yield


def register(root: str | Path, name: str, ref: str = "HEAD", message: str | None = None) -> tuple[Version, bool]:
    """Register the ``name`` that ``ref``'s dvc.lock records as a new major version, unless a
    registered version already has those bytes: ``(version, created)``."""
    with registry_lock(root):
        return _register(root, name, ref, message)


def _register(root: str | Path, name: str, ref: str, message: str | None) -> tuple[Version, bool]:
    existing, commit, _ = version_of(root, name, ref)
    if existing is not None:
        return existing, False
    # GTO bumps from the highest version; the first one it must be told
    bump = {"bump_major": True} if versions(root, name) else {"version": "v1.0.0"}
    _gto().register(str(root), name, commit, message=message, **bump)
    created = next(v for v in versions(root, name) if v.commit == commit)
    return created, True


def assign(root: str | Path, name: str, version: str, stage: str = PROD, message: str | None = None) -> Version:
    """Assign ``stage`` to ``version`` of ``name`` (a rollback when it is an earlier one)."""
    check_stage_name(stage)
    with registry_lock(root):
        target = resolve(root, f"{name}@{version}")
        _gto().assign(str(root), name, stage, version=target.version, message=message, force=True)
        return next(v for v in versions(root, name) if v.version == target.version)


def require_recorded_run(root: str | Path) -> None:
    """The gate registers HEAD: the run it judges must be what HEAD records (dvc.lock, metrics/ and
    evaluation/ as committed), so that the version registered is the one evaluated."""
    changed = (git(str(root), "status", "--porcelain", "--untracked-files=all", "--", *RUN_RECORD) or "").strip()
    if changed:
        listed = ", ".join(line[3:] for line in changed.splitlines()[:6])
        raise PipelineError(
            f"the run's record differs from HEAD ({listed}): commit dvc.lock, metrics/ and evaluation/ first "
            "(the retrain flow does), so that the version registered is the one evaluated."
        )


def recorded_file(root: str | Path, version: Version, path: str) -> str | None:
    """``path``'s text as ``version``'s commit recorded it (git); None where the commit has no such file."""
    return file_at(root, version.commit, path)


def metrics_at(root: str | Path, commit: str) -> dict[str, Any]:
    """The listed metrics (``VERSION_METRICS``) as the commit recorded them; None where absent."""
    files: dict[str, dict] = {}
    for path in {f for f, _, _ in VERSION_METRICS}:
        text = file_at(root, commit, path)
        try:
            files[path] = json.loads(text) if text else {}
        except ValueError:
            files[path] = {}
    return {label: files[path].get(key) for path, key, label in VERSION_METRICS}
