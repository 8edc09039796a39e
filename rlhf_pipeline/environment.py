"""The software environment as an input: the committed lock (``requirements.lock``), the packages
installed now, and how the two differ.

A model is the same bytes only for the same packages (``config.json`` alone records the
transformers version), so each model card records the lock's sha256 and every installed package
whose version differs from it (:func:`environment_record`); every stage declares the lock as a
dependency in ``dvc.yaml``, so regenerating it reruns the pipeline. ``rlhf lineage`` compares an
artifact's record with the running environment (:func:`compare`) and warns when they differ.

torch is installed outside the lock (its CPU or CUDA build comes from a different index, chosen
per machine; ``pyproject.toml`` pins its version): the record names its installed build apart.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from rlhf_pipeline import numerics
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.io import NotUTF8Error, decode_utf8
from rlhf_pipeline.paths import REQUIREMENTS_LOCK

# installed beside the lock by `make setup` (torch: per-machine build) or the venv's own tooling
OUTSIDE_LOCK = ("torch",)
TOOLING = ("pip", "setuptools", "wheel", "rlhf-pipeline")
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\]+)")


def canonical(name: str) -> str:
    """A distribution name as PEP 503 compares them (``Great_Expectations`` = ``great-expectations``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def locked_versions(text: str) -> dict[str, str]:
    """``{package: version}`` from a pip requirements lock (``name==version`` lines)."""
    return {canonical(m.group(1)): m.group(2) for line in text.splitlines() if (m := _PIN.match(line.strip()))}


def lock_pins(path: Path, data: bytes) -> dict[str, str]:
    """:func:`locked_versions` of the lock file ``path`` holding ``data``; a PipelineError naming the file
    when it is not UTF-8 text or pins no package (a damaged or emptied lock would otherwise be read as
    "every installed package differs from it", or end in a UnicodeDecodeError traceback)."""
    fix = "Regenerate it with `make lock`, or restore it with `git checkout -- requirements.lock`."
    try:
        text = decode_utf8(path, data)
    except NotUTF8Error as error:
        raise PipelineError(f"{error}, so it is not a pip lock. {fix}") from None
    pins = locked_versions(text)
    if not pins:
        raise PipelineError(f"{path} pins no package (no `name==version` line), so it is not a pip lock. {fix}")
    return pins


def installed_versions() -> dict[str, str]:
    """``{package: version}`` of every distribution the running interpreter can import."""
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(canonical(name), dist.version)
    return found


def lock_differences(locked: Mapping[str, str], installed: Mapping[str, str]) -> dict[str, dict[str, str | None]]:
    """Each package whose installed version is not the locked one: ``{name: {"locked", "installed"}}``
    (None where one side lacks it). torch and the venv's tooling are left out (see the module doc)."""
    skip = {*OUTSIDE_LOCK, *TOOLING}
    return {
        name: {"locked": locked.get(name), "installed": installed.get(name)}
        for name in sorted(set(locked) | set(installed))
        if name not in skip and locked.get(name) != installed.get(name)
    }


def environment_record(root: str | Path = ".") -> dict[str, Any]:
    """What a model card records of the environment that made it: the lock's sha256 (None without a
    lock), the packages that differ from it, the builds installed outside it, and the CPU numerics
    this process pinned (None where it pinned none: :mod:`rlhf_pipeline.numerics`)."""
    path = Path(root, REQUIREMENTS_LOCK)
    installed = installed_versions()
    outside = {name: installed.get(name) for name in OUTSIDE_LOCK}
    pin = numerics.pinned()
    cpu_numerics = pin.record() if pin else None
    if not path.is_file():
        return {
            "lock": None,
            "lock_sha256": None,
            "differs_from_lock": None,
            "outside_lock": outside,
            "cpu_numerics": cpu_numerics,
        }
    data = path.read_bytes()
    return {
        "lock": REQUIREMENTS_LOCK,
        "lock_sha256": hashlib.sha256(data).hexdigest(),
        "differs_from_lock": lock_differences(lock_pins(path, data), installed),
        "outside_lock": outside,
        "cpu_numerics": cpu_numerics,
    }


def record_lines(record: Mapping[str, Any]) -> list[str]:
    """The record as a model card's Lineage lines."""
    outside = ", ".join(f"{name} {version}" for name, version in (record.get("outside_lock") or {}).items())
    numerics_line = f"- cpu numerics: {numerics.describe(record.get('cpu_numerics'))}"
    if not record.get("lock_sha256"):
        return [f"- environment: no {REQUIREMENTS_LOCK} (packages unlocked); {outside}", numerics_line]
    differs = record.get("differs_from_lock") or {}
    changes = [f"{name} {v['installed'] or 'missing'} (locked {v['locked'] or 'none'})" for name, v in differs.items()]
    detail = "differs from it: " + ", ".join(changes) if changes else "every package as locked"
    lock = f"`{record['lock']}` sha256 `{record['lock_sha256']}`"
    return [f"- environment: {lock}, {detail}; outside the lock: {outside}", numerics_line]


def effective_versions(record: Mapping[str, Any], lock_text: str | None) -> dict[str, str] | None:
    """The package versions a record stands for: the lock it names (its text, found by the caller
    from the sha256), overridden by the differences it lists; None when that lock's text is unknown."""
    if lock_text is None:
        return None
    versions = dict(locked_versions(lock_text))
    for name, change in (record.get("differs_from_lock") or {}).items():
        if change.get("installed") is None:
            versions.pop(name, None)
        else:
            versions[name] = change["installed"]
    for name, version in (record.get("outside_lock") or {}).items():
        if version is not None:
            versions[name] = version
    return versions


def compare(
    recorded: Mapping[str, Any], current: Mapping[str, Any], lock_text_by_sha: Mapping[str, str]
) -> dict[str, Any]:
    """How the environment that made an artifact (``recorded``) differs from ``current``:
    ``{"same": bool, "packages": {name: {"then", "now"}}, "note": str | None}``.

    ``lock_text_by_sha`` maps lock sha256s to their text (the workspace's lock and those in git
    history): the package-level comparison needs the text of both records' locks."""
    if not recorded:
        return {"same": None, "packages": {}, "note": "the artifact records no environment (made before the lock)"}
    same_record = all(recorded.get(k) == current.get(k) for k in ("lock_sha256", "differs_from_lock", "outside_lock"))
    if same_record:
        return {"same": True, "packages": {}, "note": None}
    then = effective_versions(recorded, lock_text_by_sha.get(recorded.get("lock_sha256") or ""))
    now = effective_versions(current, lock_text_by_sha.get(current.get("lock_sha256") or ""))
    if then is None or now is None:
        missing = recorded.get("lock_sha256") if then is None else current.get("lock_sha256")
        return {
            "same": False,
            "packages": {},
            "note": f"lock sha256 {missing} is not in the workspace or git history: packages not compared",
        }
    packages = {
        name: {"then": then.get(name), "now": now.get(name)}
        for name in sorted(set(then) | set(now))
        if name not in TOOLING and then.get(name) != now.get(name)
    }
    return {"same": not packages, "packages": packages, "note": None}
