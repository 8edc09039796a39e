"""``rlhf lineage PATH``: where a DVC-tracked artifact came from, read from the audit trail itself.

Everything is derived from what DVC and git already record -- ``dvc.lock`` (and ``*.dvc`` files),
``dvc.yaml``, ``params.yaml``, the git history and the artifacts on disk -- with no bookkeeping
of our own:

* the stage that produced PATH, its command and the output hash locked for it;
* whether the workspace still matches the lock: files are re-hashed the way DVC hashes them
  (md5 of the content; a directory is the md5 of its sorted ``[{"md5", "relpath"}]`` manifest
  plus ``.dir``), and directories are compared file by file with the ``.dir`` manifest in the
  DVC cache when it is there, so a corrupted weight file is named;
* the params the stage ran with and how the current params files differ;
* its inputs, walked back through the stage deps to the sources (deps no stage produces), with
  the base model's provenance and the preference data's size and validation verdict;
* the git commit that recorded the lock, and whether the tree is dirty since;
* the metrics files the stage declares, and the package versions and device.

``--json`` prints the same as one OpenLineage ``RunEvent``-shaped object.
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import json
import os
import platform
import re
import subprocess
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from rlhf_pipeline.errors import PipelineError

PRODUCER = "https://github.com/rlhf-pipeline"
RUN_EVENT_SCHEMA = "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunEvent"
SOURCE_CODE_FACET_SCHEMA = "https://openlineage.io/spec/facets/1-0-1/SourceCodeJobFacet.json#/$defs/SourceCodeJobFacet"
SOURCE_LOCATION_FACET_SCHEMA = (
    "https://openlineage.io/spec/facets/1-0-1/SourceCodeLocationJobFacet.json#/$defs/SourceCodeLocationJobFacet"
)
PACKAGES = ("torch", "transformers", "datasets", "dvc", "prefect")
# DvcIgnoreFilter's built-in patterns: these never count towards a directory's hash.
ALWAYS_IGNORED = {".git", ".hg", ".dvc"}
ROW_COUNT_KEYS = ("rows", "num_rows", "n_rows", "pairs", "num_pairs", "n_pairs", "n_preferences", "count", "n")
VALIDATION_SUMMARY = "data/validation/summary.json"
PREFERENCES_STAGE = "preferences"
BASE_MODEL_DIR = "models/base"
_CHUNK = 1 << 20


# ------------------------------------------------------------------------------------------------
# the recorded pipeline
# ------------------------------------------------------------------------------------------------


@dataclass
class Entry:
    """One dep or out as a lock (or .dvc) file records it; ``path`` is relative to the repo root."""

    path: str
    md5: str | None
    size: int | None = None
    nfiles: int | None = None
    legacy: bool = False  # a DVC 2.x entry: text files were hashed as md5-dos2unix
    external: str | None = None  # `dvc import` / import-url: the path lives elsewhere

    @property
    def is_dir(self) -> bool:
        return bool(self.md5 and self.md5.endswith(".dir"))


@dataclass
class Stage:
    name: str  # DVC's address: "train_policy", "sub/dvc.yaml:stage" or "data/raw.dvc"
    kind: str  # "stage" (dvc.lock) or "dvcfile" (dvc add / import)
    file: str  # the file that records it, relative to the repo root
    cmd: str | None
    deps: list[Entry] = field(default_factory=list)
    outs: list[Entry] = field(default_factory=list)
    params: dict[str, dict[str, Any]] = field(default_factory=dict)  # params file -> {key: value}
    definition: dict | None = None  # the dvc.yaml entry, when it can be found
    metrics: list[str] = field(default_factory=list)


def _posix(path: str | os.PathLike) -> str:
    text = os.path.normpath(str(path)).replace(os.sep, "/")
    return "" if text == "." else text


def _join(base: str, path: str) -> str:
    return _posix(os.path.join(base, path)) if base else _posix(path)


def _is_under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


@functools.cache
def _yaml12_float_loader():
    """A SafeLoader that also reads YAML 1.2 floats without a dot (``1e-05``), built once."""
    import yaml

    class Yaml12Floats(yaml.SafeLoader):
        pass

    Yaml12Floats.add_implicit_resolver("tag:yaml.org,2002:float", _YAML12_FLOAT, list("-+0123456789."))
    return Yaml12Floats


def _load_yaml(path: Path) -> Any:
    """Read YAML as DVC writes it (YAML 1.2): ``1e-05`` in dvc.lock is a float, not the string
    PyYAML's 1.1 rules make of it, so it compares equal to ``1.0e-5`` in params.yaml."""
    import yaml

    with open(path, encoding="utf-8") as handle:
        return yaml.load(handle, Loader=_yaml12_float_loader())  # noqa: S506 (a SafeLoader subclass)


# YAML 1.2 core-schema floats that YAML 1.1 reads as strings: an exponent without a dot.
_YAML12_FLOAT = re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$")


def _entry(raw: dict, base: str) -> Entry:
    hash_name = raw.get("hash")
    md5 = raw.get("md5") or raw.get("checksum")
    return Entry(
        path=_join(base, str(raw["path"])),
        md5=str(md5) if md5 else None,
        size=raw.get("size"),
        nfiles=raw.get("nfiles"),
        legacy=md5 is not None and hash_name is None,
        external=(raw.get("repo") or {}).get("url") if isinstance(raw.get("repo"), dict) else None,
    )


class Pipeline:
    """The stages recorded under one DVC repo root, plus the hashing needed to audit them."""

    def __init__(self, root: Path):
        self.root = root
        self.stages: dict[str, Stage] = {}
        self.lock_files: list[str] = []
        self._hashes: dict[tuple[str, bool], tuple[str | None, dict[str, str] | None]] = {}
        self._ignore = None
        self._ignore_checked = False
        lock_files, dvc_files = self._discover()
        for lock in lock_files:
            self._load_lock(lock)
        for dvc_file in dvc_files:
            self._load_dvc_file(dvc_file)

    # -- discovery -----------------------------------------------------------------------------

    def _discover(self) -> tuple[list[str], list[str]]:
        listed = _git(self.root, "ls-files", "-co", "--exclude-standard", "--", "dvc.lock", "*/dvc.lock", "*.dvc")
        if listed is not None:
            names = sorted({_posix(line) for line in listed.splitlines() if line.strip()})
            names = [name for name in names if (self.root / name).is_file()]
        else:
            names = []
            for dirpath, dirnames, filenames in os.walk(self.root):
                dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in {"node_modules", "__pycache__", "venv"}]
                rel = _posix(os.path.relpath(dirpath, self.root))
                names += [_join(rel, f) for f in filenames if f == "dvc.lock" or f.endswith(".dvc")]
        locks = [n for n in names if PurePosixPath(n).name == "dvc.lock"]
        if (self.root / "dvc.lock").is_file() and "dvc.lock" not in locks:
            locks.insert(0, "dvc.lock")
        locks.sort(key=lambda n: (n != "dvc.lock", n))
        return locks, [n for n in names if n.endswith(".dvc")]

    def _load_lock(self, lock: str) -> None:
        data = _load_yaml(self.root / lock) or {}
        if not isinstance(data, dict) or str(data.get("schema", "")) != "2.0" or not isinstance(data.get("stages"), dict):
            raise PipelineError(
                f"{lock} in {self.root} is not a DVC 2.x/3.x lock file (expected `schema: '2.0'` with a "
                "`stages:` mapping); re-create it with `dvc repro` using the DVC in this environment."
            )
        self.lock_files.append(lock)
        base = _posix(PurePosixPath(lock).parent)
        dvc_yaml = self.root / base / "dvc.yaml"
        definitions = {}
        if dvc_yaml.is_file():
            try:
                definitions = (_load_yaml(dvc_yaml) or {}).get("stages") or {}
            except Exception:  # an unreadable dvc.yaml must not hide what the lock says
                definitions = {}
        for name, raw in data["stages"].items():
            definition = definitions.get(name)
            if definition is None and "@" in name:
                definition = None  # foreach/matrix instances: their definition is a template
            wdir = _join(base, str(definition.get("wdir", "."))) if isinstance(definition, dict) else base
            address = name if not base else f"{base}/dvc.yaml:{name}"
            stage = Stage(
                name=address,
                kind="stage",
                file=lock,
                cmd=_cmd_text(raw.get("cmd")),
                deps=[_entry(d, wdir) for d in raw.get("deps") or []],
                outs=[_entry(o, wdir) for o in raw.get("outs") or []],
                params={_join(wdir, f): dict(v or {}) for f, v in (raw.get("params") or {}).items()},
                definition=definition if isinstance(definition, dict) else None,
            )
            if stage.definition:
                for item in stage.definition.get("metrics") or []:
                    path = next(iter(item)) if isinstance(item, dict) else item
                    if isinstance(path, str) and "${" not in path:
                        stage.metrics.append(_join(wdir, path))
            self.stages[address] = stage

    def _load_dvc_file(self, dvc_file: str) -> None:
        try:
            data = _load_yaml(self.root / dvc_file) or {}
        except Exception:
            return
        if not isinstance(data, dict) or not data.get("outs"):
            return
        base = _join(_posix(PurePosixPath(dvc_file).parent), str(data.get("wdir", ".")))
        self.stages[dvc_file] = Stage(
            name=dvc_file,
            kind="dvcfile",
            file=dvc_file,
            cmd=_cmd_text(data.get("cmd")),
            deps=[_entry(d, base) for d in data.get("deps") or []],
            outs=[_entry(o, base) for o in data["outs"]],
        )

    # -- queries ---------------------------------------------------------------------------------

    def producer_of(self, path: str) -> tuple[Stage, Entry] | None:
        """The stage (or .dvc file) whose output is PATH or contains it."""
        best = None
        for stage in self.stages.values():
            for out in stage.outs:
                if _is_under(path, out.path) and (best is None or len(out.path) > len(best[1].path)):
                    best = (stage, out)
        return best

    def pipeline_producers(self, path: str) -> list[tuple[Stage, Entry]]:
        """Pipeline stages writing PATH, something containing it or something inside it."""
        found = []
        for stage in self.stages.values():
            if stage.kind != "stage":
                continue
            for out in stage.outs:
                if _is_under(path, out.path) or _is_under(out.path, path):
                    found.append((stage, out))
        return found

    def tracked_by(self, path: str) -> tuple[Stage, Entry] | None:
        for stage in self.stages.values():
            if stage.kind == "dvcfile":
                for out in stage.outs:
                    if _is_under(path, out.path):
                        return stage, out
        return None

    def consumers_of(self, path: str) -> list[str]:
        return [
            s.name for s in self.stages.values() if s.kind == "stage" and any(_is_under(path, d.path) or _is_under(d.path, path) for d in s.deps)
        ]

    # -- hashing, DVC style ----------------------------------------------------------------------

    def _ignore_filter(self):
        """DVC's own .dvcignore matcher, loaded only when a .dvcignore has patterns."""
        if not self._ignore_checked:
            self._ignore_checked = True
            dvcignore = self.root / ".dvcignore"
            try:
                patterns = [
                    line for line in dvcignore.read_text(encoding="utf-8").splitlines() if line.strip() and not line.lstrip().startswith("#")
                ]
            except OSError:
                patterns = []
            if patterns:
                try:
                    from dvc.fs import LocalFileSystem
                    from dvc.ignore import DvcIgnoreFilter

                    self._ignore = DvcIgnoreFilter(LocalFileSystem(), str(self.root))
                except Exception:
                    self._ignore = None
        return self._ignore

    def workspace_hash(self, path: str, legacy: bool = False) -> tuple[str | None, dict[str, str] | None]:
        """(md5 as DVC would record it, {relpath: md5} for a directory); (None, None) if missing."""
        key = (path, legacy)
        if key not in self._hashes:
            target = self.root / path
            if target.is_file():
                self._hashes[key] = (_file_md5(target, legacy), None)
            elif target.is_dir():
                entries = self._dir_entries(target, legacy)
                self._hashes[key] = (_tree_md5(entries), entries)
            else:
                self._hashes[key] = (None, None)
        return self._hashes[key]

    def _dir_entries(self, directory: Path, legacy: bool) -> dict[str, str]:
        ignore = self._ignore_filter()
        entries: dict[str, str] = {}
        for dirpath, dirnames, filenames in os.walk(directory, followlinks=True):
            dirnames[:] = sorted(
                d for d in dirnames if d not in ALWAYS_IGNORED and not (ignore and ignore.is_ignored_dir(os.path.join(dirpath, d)))
            )
            for name in filenames:
                full = os.path.join(dirpath, name)
                if ignore and ignore.is_ignored_file(full):
                    continue
                entries[_posix(os.path.relpath(full, directory))] = _file_md5(Path(full), legacy)
        return entries

    def manifest(self, md5: str | None) -> dict[str, str] | None:
        """The ``.dir`` manifest DVC cached for a directory hash, as {relpath: md5}."""
        if not md5 or not md5.endswith(".dir"):
            return None
        for cache in self._cache_dirs():
            for candidate in (cache / "files" / "md5" / md5[:2] / md5[2:], cache / md5[:2] / md5[2:]):
                if candidate.is_file():
                    try:
                        items = json.loads(candidate.read_text(encoding="utf-8"))
                        return {str(i["relpath"]): str(i.get("md5") or i.get("md5-dos2unix")) for i in items}
                    except (OSError, ValueError, KeyError, TypeError):
                        return None
        return None

    def _cache_dirs(self) -> list[Path]:
        dirs = []
        for config in (".dvc/config.local", ".dvc/config"):
            value = _ini_value(self.root / config, "cache", "dir")
            if value:
                path = Path(os.path.expanduser(value))
                dirs.append(path if path.is_absolute() else (self.root / ".dvc" / path).resolve())
        dirs.append(self.root / ".dvc" / "cache")
        return dirs

    def check(self, entry: Entry) -> dict[str, Any]:
        """Compare the workspace with a recorded entry: status ok / modified / missing / unknown."""
        result: dict[str, Any] = {"path": entry.path, "locked": entry.md5, "workspace": None, "status": "unknown"}
        if entry.external:
            result["status"] = "external"
            return result
        current, entries = self.workspace_hash(entry.path, entry.legacy)
        result["workspace"] = current
        if entry.md5 is None:
            result["status"] = "unknown" if current else "missing"
        elif current is None:
            result["status"] = "missing"
        elif current == entry.md5:
            result["status"] = "ok"
        else:
            result["status"] = "modified"
            recorded = self.manifest(entry.md5)
            if entries is not None and recorded is not None:
                result["files"] = {
                    "modified": sorted(_join(entry.path, r) for r in entries.keys() & recorded.keys() if entries[r] != recorded[r]),
                    "added": sorted(_join(entry.path, r) for r in entries.keys() - recorded.keys()),
                    "deleted": sorted(_join(entry.path, r) for r in recorded.keys() - entries.keys()),
                }
            elif entries is not None:
                result["files"] = None  # the .dir manifest is not in the cache: no per-file detail
        return result


def _cmd_text(cmd: Any) -> str | None:
    if cmd is None:
        return None
    if isinstance(cmd, list):
        return " && ".join(str(c) for c in cmd)
    return str(cmd)


def _file_md5(path: Path, dos2unix: bool = False) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as handle:
        if dos2unix and _is_text(handle.read(512)):
            handle.seek(0)
            digest.update(handle.read().replace(b"\r\n", b"\n"))
            return digest.hexdigest()
        handle.seek(0)
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _is_text(block: bytes) -> bool:
    """DVC's istextblock heuristic (for DVC 2.x md5-dos2unix entries)."""
    if not block:
        return True
    if b"\x00" in block:
        return False
    nontext = block.translate(None, bytes(range(32, 127)) + b"\n\r\t\f\b")
    return len(nontext) / len(block) <= 0.30


def _tree_md5(entries: dict[str, str]) -> str:
    """DVC's directory hash: md5 of the JSON manifest sorted by relpath, plus ``.dir``."""
    manifest = [{"md5": entries[rel], "relpath": rel} for rel in sorted(entries)]
    blob = json.dumps(manifest, sort_keys=True).encode("utf-8")
    return hashlib.md5(blob, usedforsecurity=False).hexdigest() + ".dir"


def _ini_value(path: Path, section: str, key: str) -> str | None:
    """One value from DVC's configobj-style config (indented ``key = value`` under ``[section]``)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    current = None
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("[") and stripped.endswith("]"):
            current = stripped[1:-1].strip().strip("'\"")
        elif current == section and "=" in stripped and not stripped.startswith("#"):
            name, value = stripped.split("=", 1)
            if name.strip() == key:
                return value.strip()
    return None


# ------------------------------------------------------------------------------------------------
# git, params, annotations, environment
# ------------------------------------------------------------------------------------------------


def _git(root: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def git_info(root: Path, record_file: str, params_files: list[str]) -> dict[str, Any]:
    """The last commit that changed the lock/.dvc file and whether the tree moved on since."""
    info: dict[str, Any] = {"recordFile": record_file, "commit": None, "dirty": None}
    if _git(root, "rev-parse", "--is-inside-work-tree") is None:
        info["note"] = f"{root} is not in a git work tree"
        return info
    sha = (_git(root, "log", "-1", "--format=%H", "--", record_file) or "").strip()
    status = _git(root, "status", "--porcelain", "--untracked-files=no") or ""
    dirty_files = sorted({_posix(line[3:].split(" -> ")[-1].strip('"')) for line in status.splitlines() if len(line) > 3})
    info["head"] = (_git(root, "rev-parse", "HEAD") or "").strip() or None
    remote = (_git(root, "config", "--get", "remote.origin.url") or "").strip()
    info["url"] = remote or root.resolve().as_uri()
    if not sha:
        info["note"] = f"{record_file} has never been committed"
        info["dirty"] = True
        info["dirtyFiles"] = dirty_files
        return info
    info["commit"] = sha
    info["committedAt"] = (_git(root, "log", "-1", "--format=%cI", sha) or "").strip() or None
    watched = [record_file, *params_files]
    changed = _git(root, "diff", "--name-only", sha, "--", *watched)
    changed_since = sorted(_posix(p) for p in (changed or "").splitlines() if p.strip())
    # a params file the commit never had counts as changed, not as clean
    for params_file in params_files:
        if (root / params_file).exists() and _git(root, "cat-file", "-e", f"{sha}:{params_file}") is None:
            if params_file not in changed_since:
                changed_since.append(params_file)
    info["changedSinceCommit"] = changed_since
    info["dirtyFiles"] = dirty_files
    info["dirty"] = bool(changed_since or dirty_files)
    return info


def _flatten(prefix: str, value: Any) -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, sub in value.items():
            out.update(_flatten(f"{prefix}.{key}" if prefix else str(key), sub))
        return out
    return {prefix: value}


_MISSING = object()


def _lookup(data: Any, dotted: str) -> Any:
    node = data
    for part in dotted.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def _param_label(params_file: str, key: str) -> str:
    return key if params_file == "params.yaml" else f"{params_file}:{key}"


class ParamsReader:
    def __init__(self, root: Path):
        self.root = root
        self._cache: dict[str, Any] = {}

    def current(self, params_file: str) -> Any:
        if params_file not in self._cache:
            path = self.root / params_file
            try:
                if path.suffix == ".json":
                    self._cache[params_file] = json.loads(path.read_text(encoding="utf-8"))
                else:
                    self._cache[params_file] = _load_yaml(path) or {}
            except FileNotFoundError:
                self._cache[params_file] = _MISSING
            except Exception:
                self._cache[params_file] = _MISSING
        return self._cache[params_file]

    def used(self, stage: Stage) -> dict[str, Any]:
        """The stage's locked params as flat ``key: value`` leaves."""
        flat: dict[str, Any] = {}
        for params_file, values in stage.params.items():
            for key, value in values.items():
                for leaf, leaf_value in _flatten(key, value).items():
                    flat[_param_label(params_file, leaf)] = leaf_value
        return flat

    def diff(self, stage: Stage) -> dict[str, dict[str, Any]]:
        """{key: {"old", "new"}} for every locked param whose current value differs."""
        changes: dict[str, dict[str, Any]] = {}
        for params_file, values in stage.params.items():
            current = self.current(params_file)
            for key, old in values.items():
                new = _MISSING if current is _MISSING else _lookup(current, key)
                old_leaves = _flatten(key, old)
                new_leaves = {} if new is _MISSING else _flatten(key, new)
                for leaf in sorted(old_leaves.keys() | new_leaves.keys()):
                    before = old_leaves.get(leaf, _MISSING)
                    after = new_leaves.get(leaf, _MISSING)
                    if before is _MISSING or after is _MISSING or before != after or type(before) is not type(after):
                        if before is not _MISSING and after is not _MISSING and before == after and isinstance(before, (int, float)):
                            continue  # 1 vs 1.0 is the same value for a stage
                        changes[_param_label(params_file, leaf)] = {
                            "old": None if before is _MISSING else before,
                            "new": None if after is _MISSING else after,
                            **({"status": "added"} if before is _MISSING else {}),
                            **({"status": "removed"} if after is _MISSING else {}),
                        }
        return changes


def read_front_matter(path: Path) -> dict:
    """YAML between the first two ``---`` lines of a model card; {} if absent or unreadable."""
    import yaml

    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return {}
    if not lines or lines[0].strip() != "---":
        return {}
    for end in range(1, len(lines)):
        if lines[end].strip() == "---":
            try:
                data = yaml.safe_load("\n".join(lines[1:end]))
            except yaml.YAMLError:
                return {}
            return data if isinstance(data, dict) else {}
    return {}


def _model_card(root: Path, path: str) -> tuple[str, dict] | None:
    target = root / path
    card = target / "README.md" if target.is_dir() else target if target.name == "README.md" else None
    if card is None or not card.is_file():
        return None
    front = read_front_matter(card)
    return (_posix(card.relative_to(root)), front) if front else None


def _read_metrics_file(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {"error": "missing"}
    except OSError as error:
        return {"error": str(error)}
    try:
        return json.loads(text)
    except ValueError:
        try:
            import yaml

            return yaml.safe_load(text)
        except Exception:
            return {"error": "not JSON or YAML"}


def _find_row_count(payload: Any) -> int | None:
    if not isinstance(payload, dict):
        return None
    for key in ROW_COUNT_KEYS:
        value = payload.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, dict) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value.values()):
            return sum(value.values())  # per split
    for key, value in payload.items():
        if ("rows" in str(key) or "pairs" in str(key)) and isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _count_rows(target: Path) -> int | None:
    """Rows of a ``datasets`` save_to_disk directory (Dataset or DatasetDict), a jsonl or a parquet."""
    try:
        if target.is_dir():
            if (target / "dataset_dict.json").is_file():
                splits = json.loads((target / "dataset_dict.json").read_text()).get("splits") or []
                counts = [_count_rows(target / split) for split in splits]
                return sum(c for c in counts if c is not None) if counts and None not in counts else None
            state = target / "state.json"
            if state.is_file():
                import pyarrow as pa

                files = json.loads(state.read_text()).get("_data_files") or []
                total = 0
                for item in files:
                    with pa.memory_map(str(target / item["filename"])) as source:
                        total += sum(batch.num_rows for batch in pa.ipc.open_stream(source))
                return total
            return None
        if target.suffix == ".jsonl":
            with open(target, "rb") as handle:
                return sum(1 for line in handle if line.strip())
        if target.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(target).metadata.num_rows
    except Exception:
        return None
    return None


def annotate(pipeline: Pipeline, path: str, producer: Stage | None) -> dict[str, Any]:
    """Known-source annotations: base model provenance, preference data size and GX verdict."""
    notes: dict[str, Any] = {}
    card = _model_card(pipeline.root, path)
    if card:
        card_path, front = card
        if "source" in front or "source_sha256" in front or path == BASE_MODEL_DIR:
            notes["baseModel"] = {
                "card": card_path,
                **{k: front.get(k) for k in ("source", "source_sha256", "source_file", "base_model", "revision") if front.get(k) is not None},
            }
        else:
            notes["modelCard"] = {
                "card": card_path,
                **{k: front.get(k) for k in ("base_model", "library_name", "device", "license") if front.get(k) is not None},
            }
    is_preferences = (producer is not None and producer.name.split(":")[-1] == PREFERENCES_STAGE) or _is_under(path, "data/preferences")
    if is_preferences:
        rows, rows_source = None, None
        candidates = [_join(path, "metrics.json")] + (producer.metrics if producer else [])
        for candidate in candidates:
            if (pipeline.root / candidate).is_file():
                rows = _find_row_count(_read_metrics_file(pipeline.root / candidate))
                if rows is not None:
                    rows_source = candidate
                    break
        if rows is None:
            rows = _count_rows(pipeline.root / path)
            rows_source = "counted" if rows is not None else None
        summary_path = pipeline.root / VALIDATION_SUMMARY
        validation: dict[str, Any] = {"summary": VALIDATION_SUMMARY, "success": None}
        if summary_path.is_file():
            summary = _read_metrics_file(summary_path)
            if isinstance(summary, dict) and isinstance(summary.get("success"), bool):
                validation["success"] = summary["success"]
        else:
            validation["note"] = "no validation summary"
        notes["preferenceData"] = {"rows": rows, "rowsSource": rows_source, "validation": validation}
    return notes


def environment(pipeline: Pipeline, cards: list[str]) -> dict[str, Any]:
    from importlib import metadata

    env: dict[str, Any] = {}
    for package in PACKAGES:
        try:
            env[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            env[package] = "not installed"
    env["python"] = platform.python_version()
    for path in cards:
        card = _model_card(pipeline.root, path)
        if card and card[1].get("device"):
            env["device"] = str(card[1]["device"])
            env["deviceSource"] = card[0]
            return env
    env["device"] = _current_device()
    env["deviceSource"] = "current machine"
    return env


def _current_device() -> str:
    try:
        import torch
    except Exception:
        return "cpu"
    try:
        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:
        pass
    return "cpu"


# ------------------------------------------------------------------------------------------------
# the report
# ------------------------------------------------------------------------------------------------


def find_dvc_root(start: Path) -> Path | None:
    current = start if start.is_dir() else start.parent
    while not current.exists():
        current = current.parent
    for candidate in (current, *current.parents):
        if (candidate / ".dvc").is_dir():
            return candidate
    return None


def _stage_reasons(pipeline: Pipeline, params: ParamsReader, stage: Stage) -> tuple[list[str], dict[str, dict]]:
    """Why a stage would re-run (dvc status style) and the per-entry checks behind it."""
    reasons: list[str] = []
    checks: dict[str, dict] = {}
    for kind, entries in (("dep", stage.deps), ("out", stage.outs)):
        for entry in entries:
            check = pipeline.check(entry)
            checks[f"{kind}:{entry.path}"] = check
            if check["status"] in ("modified", "missing"):
                reasons.append(f"{kind} {entry.path} {check['status']}{_files_note(check)}")
    if stage.kind == "stage":
        for key, change in params.diff(stage).items():
            reasons.append(f"param {key} changed: {_show(change['old'])} -> {_show(change['new'])}")
        if stage.definition is None and "@" not in stage.name:  # foreach/matrix instances are templated
            reasons.append(f"stage is no longer defined in {PurePosixPath(stage.file).parent / 'dvc.yaml'}")
        else:
            defined = _cmd_text(stage.definition.get("cmd"))
            if defined is not None and "${" not in defined and defined != stage.cmd:
                reasons.append(f"command changed in dvc.yaml: {defined!r}")
        for dep in stage.deps:
            producer = pipeline.producer_of(dep.path)
            if producer and producer[0] is not stage and producer[1].path == dep.path and producer[1].md5 and dep.md5 and producer[1].md5 != dep.md5:
                reasons.append(f"dep {dep.path} was locked at {dep.md5} but {producer[0].name} has since produced {producer[1].md5}")
    return reasons, checks


def _files_note(check: dict) -> str:
    files = check.get("files")
    if not files:
        return ""
    parts = [f"{label} {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}" for label, names in files.items() if names]
    return f" ({'; '.join(parts)})" if parts else ""


def _show(value: Any) -> str:
    return "(unset)" if value is None else json.dumps(value, default=str) if not isinstance(value, str) else value


def build_lineage(path: str | os.PathLike) -> dict[str, Any]:
    """The OpenLineage-shaped RunEvent for the stage run that produced PATH."""
    absolute = Path(os.path.abspath(path))
    root = find_dvc_root(absolute)
    if root is None:
        raise PipelineError(
            f"{path} is not inside a DVC repository: no .dvc/ directory in {absolute.parent} or any parent. "
            "Run `rlhf lineage` from the project (where `dvc init` was run) on an artifact the pipeline produced."
        )
    rel = _posix(os.path.relpath(absolute, root))
    if rel.startswith("../") or rel == "..":
        raise PipelineError(f"{path} is outside the DVC repository at {root}.")
    if rel.endswith(".dvc") and not (root / rel).is_dir():
        tracked = _load_yaml(root / rel) if (root / rel).is_file() else None
        outs = (tracked or {}).get("outs") if isinstance(tracked, dict) else None
        if outs:
            rel = _join(_posix(PurePosixPath(rel).parent), str(outs[0]["path"]))
    pipeline = Pipeline(root)
    if not pipeline.stages:
        raise PipelineError(
            f"{path} has no recorded lineage: there is no dvc.lock (nor any .dvc file) in {root}. "
            "Run `dvc repro` first so DVC records which stage produced what."
        )
    found = pipeline.producer_of(rel)
    if found is None:
        raise PipelineError(_not_produced_message(pipeline, path, rel))
    stage, out = found
    params = ParamsReader(root)
    namespace = f"dvc://{root.name}"

    # the lineage: the producing stage, then upstream stages breadth first
    order: list[Stage] = [stage]
    inputs: dict[str, dict[str, Any]] = {}
    queue = deque([stage])
    while queue:
        current = queue.popleft()
        for dep in current.deps:
            slot = inputs.setdefault(dep.path, {"entry": dep, "consumers": [], "producers": []})
            if current.name not in slot["consumers"]:
                slot["consumers"].append(current.name)
            for producer, _ in pipeline.pipeline_producers(dep.path):
                if producer is current:
                    continue
                if producer.name not in slot["producers"]:
                    slot["producers"].append(producer.name)
                if producer not in order:
                    order.append(producer)
                    queue.append(producer)

    stage_reports = []
    all_reasons: list[str] = []
    checks: dict[str, dict] = {}
    for item in order:
        reasons, item_checks = _stage_reasons(pipeline, params, item)
        checks.update({f"{item.name}|{k}": v for k, v in item_checks.items()})
        stage_reports.append(
            {
                "name": item.name,
                "kind": item.kind,
                "recordedIn": item.file,
                "cmd": item.cmd,
                "deps": [d.path for d in item.deps],
                "outs": [o.path for o in item.outs],
                "parameters": params.used(item),
                "stale": bool(reasons),
                "reasons": reasons,
            }
        )
        all_reasons += [f"{item.name}: {reason}" for reason in reasons]

    # the artifact itself (possibly a file inside an output directory)
    out_check = pipeline.check(out)
    artifact: dict[str, Any] = {"path": rel, "output": out.path, "lockedHash": out.md5}
    if rel == out.path:
        artifact.update(workspaceHash=out_check["workspace"], status=out_check["status"])
        if out_check.get("files"):
            artifact["files"] = out_check["files"]
    else:
        inner = rel[len(out.path) + 1 :]
        recorded = pipeline.manifest(out.md5)
        locked = recorded.get(inner) if recorded is not None else None
        current = _file_md5(root / rel) if (root / rel).is_file() else None
        if (root / rel).is_dir():
            current = pipeline.workspace_hash(rel)[0]
        artifact["lockedHash"] = locked
        artifact["workspaceHash"] = current
        if recorded is None:
            artifact["status"] = "modified" if out_check["status"] == "modified" else out_check["status"]
            artifact["note"] = f"no .dir manifest for {out.path} in the DVC cache; compared the whole directory"
        elif locked is None and (root / rel).is_dir():
            prefix = inner + "/"
            sub = {k[len(prefix) :]: v for k, v in recorded.items() if k.startswith(prefix)}
            artifact["lockedHash"] = _tree_md5(sub) if sub else None
            artifact["status"] = "ok" if sub and artifact["lockedHash"] == current else "modified"
        elif locked is None:
            artifact["status"] = "missing" if current is None else "untracked"
        else:
            artifact["status"] = "ok" if current == locked else ("missing" if current is None else "modified")
    artifact_stale = artifact["status"] not in ("ok",)
    git = git_info(root, stage.file, sorted({f for s in order for f in s.params}))

    # inputs, walked back to the sources
    input_datasets = []
    for dep_path, slot in inputs.items():
        entry: Entry = slot["entry"]
        check = pipeline.check(entry)
        producer_stage = pipeline.stages[slot["producers"][0]] if slot["producers"] else None
        facets: dict[str, Any] = {
            "hash": entry.md5,
            "size": entry.size,
            "nfiles": entry.nfiles,
            "producedBy": slot["producers"][0] if len(slot["producers"]) == 1 else (slot["producers"] or None),
            "consumedBy": slot["consumers"],
            "source": not slot["producers"],
            "stale": check["status"] in ("modified", "missing"),
            "status": check["status"],
        }
        tracked = pipeline.tracked_by(dep_path)
        if tracked:
            facets["trackedBy"] = tracked[0].name
        if entry.external:
            facets["importedFrom"] = entry.external
        if check.get("files"):
            facets["files"] = check["files"]
        facets.update(annotate(pipeline, dep_path, producer_stage))
        input_datasets.append({"namespace": namespace, "name": dep_path, "facets": facets})

    metrics = {m: _read_metrics_file(root / m) for m in stage.metrics}
    upstream_metrics = {m: _read_metrics_file(root / m) for s in order[1:] for m in s.metrics}

    output_datasets = []
    for item in stage.outs:
        check = pipeline.check(item)
        facets = {
            "hash": item.md5,
            "size": item.size,
            "nfiles": item.nfiles,
            "producedBy": stage.name,
            "metric": item.path in stage.metrics,
            "stale": check["status"] in ("modified", "missing"),
            "status": check["status"],
        }
        if check.get("files"):
            facets["files"] = check["files"]
        facets.update(annotate(pipeline, item.path, stage))
        output_datasets.append({"namespace": namespace, "name": item.path, "facets": facets})

    params_diff: dict[str, dict[str, Any]] = {}
    for item in order:
        if item.kind != "stage":
            continue
        for key, change in params.diff(item).items():
            slot = params_diff.setdefault(key, {**change, "stages": []})
            slot["stages"].append(item.name)

    out_hashes = ",".join(f"{o.path}={o.md5}" for o in sorted(stage.outs, key=lambda o: o.path))
    run_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"{namespace}/{stage.name}?outs={out_hashes}"))
    card_dirs = [rel, out.path] + [o.path for o in stage.outs if o.path != out.path]

    job_facets: dict[str, Any] = {
        "sourceCode": {
            "_producer": PRODUCER,
            "_schemaURL": SOURCE_CODE_FACET_SCHEMA,
            "language": "shell",
            "sourceCode": stage.cmd if stage.cmd is not None else f"dvc add {out.path}",
        },
        "sourceCodeLocation": {
            "_producer": PRODUCER,
            "_schemaURL": SOURCE_LOCATION_FACET_SCHEMA,
            "type": "git",
            "url": git.get("url") or root.resolve().as_uri(),
            "path": stage.file,
            "version": git.get("commit"),
        },
    }
    return {
        "eventType": "COMPLETE",
        "eventTime": _dt.datetime.now(_dt.timezone.utc).isoformat().replace("+00:00", "Z"),
        "producer": PRODUCER,
        "schemaURL": RUN_EVENT_SCHEMA,
        "job": {"namespace": namespace, "name": stage.name, "facets": job_facets},
        "run": {
            "runId": run_id,
            "facets": {
                "artifact": artifact,
                "parameters": params.used(stage),
                "upstreamParameters": {s.name: params.used(s) for s in order[1:] if s.params},
                "paramsDiff": params_diff,
                "git": git,
                "environment": environment(pipeline, card_dirs),
                "metrics": metrics,
                "upstreamMetrics": upstream_metrics,
                "stale": {
                    "stale": artifact_stale or bool(all_reasons),
                    "artifactModified": artifact_stale,
                    "reasons": all_reasons,
                },
                "dvcStages": stage_reports,
            },
        },
        "inputs": input_datasets,
        "outputs": output_datasets,
    }


def _not_produced_message(pipeline: Pipeline, path: str, rel: str) -> str:
    inside = sorted({f"{o.path} ({s.name})" for s in pipeline.stages.values() for o in s.outs if _is_under(o.path, rel) and o.path != rel})
    if inside and rel:
        return (
            f"{path} is not itself an output of any DVC stage, but it contains outputs: {', '.join(inside[:8])}"
            f"{' ...' if len(inside) > 8 else ''}. Run `rlhf lineage` on one of those."
        )
    consumers = pipeline.consumers_of(rel) if rel else []
    if consumers:
        return (
            f"{path} is not produced by any DVC stage (nor tracked by a .dvc file): it is a plain source "
            f"that stage(s) {', '.join(consumers)} read. Ask for the lineage of one of their outputs instead, "
            f"or track it with `dvc add {rel}`."
        )
    locks = ", ".join(pipeline.lock_files) or "no dvc.lock"
    return (
        f"{path} is not produced by any DVC stage: no output in {locks} (nor any .dvc file) is or contains it. "
        "Check the path (it is resolved from the current directory), or run `dvc repro` if the stage that "
        "should write it has not run yet."
    )


# ------------------------------------------------------------------------------------------------
# text rendering and the CLI
# ------------------------------------------------------------------------------------------------


def _size(entry_facets: dict) -> str:
    parts = []
    if entry_facets.get("nfiles") is not None:
        parts.append(f"{entry_facets['nfiles']} files")
    if entry_facets.get("size") is not None:
        parts.append(_human_bytes(entry_facets["size"]))
    return f" ({', '.join(parts)})" if parts else ""


def _human_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


def _status_word(status: str) -> str:
    return {"ok": "up to date", "modified": "MODIFIED", "missing": "MISSING", "unknown": "not hashed", "external": "external"}.get(
        status, status.upper()
    )


def render_text(event: dict[str, Any]) -> str:
    run = event["run"]["facets"]
    job = event["job"]
    artifact = run["artifact"]
    stale = run["stale"]
    git = run["git"]
    lines = [f"Lineage of {artifact['path']}"]
    stage_report = run["dvcStages"][0]
    lines.append(f"  stage        {job['name']}  (recorded in {stage_report['recordedIn']})")
    lines.append(f"  command      {job['facets']['sourceCode']['sourceCode']}")
    out_facets = next((o["facets"] for o in event["outputs"] if o["name"] == artifact["output"]), {})
    lines.append(f"  output       {artifact['output']}  md5 {out_facets.get('hash')}{_size(out_facets)}")
    if artifact["path"] != artifact["output"]:
        lines.append(f"  file         {artifact['path']}  md5 {artifact.get('lockedHash')}")
    workspace = _status_word(artifact["status"])
    if artifact.get("files"):
        workspace += _files_note({"files": artifact["files"]})
    if artifact["status"] == "modified" and artifact.get("workspaceHash"):
        workspace += f"; workspace md5 {artifact['workspaceHash']}"
    lines.append(f"  workspace    {workspace}")
    lines.append(f"  run id       {event['run']['runId']}")
    if git.get("commit"):
        dirt = "clean"
        if git.get("dirty"):
            bits = []
            if git.get("changedSinceCommit"):
                bits.append(f"{', '.join(git['changedSinceCommit'])} changed since that commit")
            if git.get("dirtyFiles"):
                bits.append(f"uncommitted changes: {', '.join(git['dirtyFiles'][:6])}{' ...' if len(git['dirtyFiles']) > 6 else ''}")
            dirt = "DIRTY: " + "; ".join(bits)
        lines.append(f"  git          {git['commit']}  ({dirt})")
    else:
        lines.append(f"  git          not recorded ({git.get('note', 'unknown')})")
    if stale["stale"]:
        lines.append("  verdict      STALE: `dvc repro` would change this lineage")
        lines += [f"                 - {reason}" for reason in stale["reasons"]]
        if stale["artifactModified"] and not any(artifact["output"] in r for r in stale["reasons"]):
            lines.append(f"                 - {artifact['path']} {artifact['status']} in the workspace")
    else:
        lines.append("  verdict      up to date: workspace, params and commands match dvc.lock")

    lines.append("")
    lines.append(f"Parameters (stage {job['name']}, from {stage_report['recordedIn']})")
    lines += [f"  {k} = {_show(v)}" for k, v in run["parameters"].items()] or ["  (none)"]
    for name, values in run["upstreamParameters"].items():
        lines.append(f"  upstream {name}: " + ", ".join(f"{k}={_show(v)}" for k, v in values.items()))
    lines.append("Changed in the params files since that run")
    if run["paramsDiff"]:
        for key, change in run["paramsDiff"].items():
            lines.append(f"  {key}: {_show(change['old'])} -> {_show(change['new'])}  (stage {', '.join(change['stages'])})")
    else:
        lines.append("  (none)")

    lines.append("")
    lines.append("Stages (producing stage first, then upstream)")
    for report in run["dvcStages"]:
        verdict = "up to date" if not report["stale"] else "STALE: " + "; ".join(report["reasons"])
        lines.append(f"  {report['name']}: {report['cmd'] or '(dvc add)'}")
        lines.append(f"      {verdict}")

    lines.append("")
    lines.append("Inputs (walked back to the sources)")
    if not event["inputs"]:
        lines.append("  (none)")
    for dataset in event["inputs"]:
        facets = dataset["facets"]
        produced = facets["producedBy"]
        if produced is None:
            origin = "source" + (f", tracked by {facets['trackedBy']}" if facets.get("trackedBy") else "")
        else:
            origin = f"from {produced if isinstance(produced, str) else ', '.join(produced)}"
        status = _status_word(facets["status"]) + _files_note(facets)
        lines.append(f"  {dataset['name']}")
        lines.append(f"      md5 {facets['hash']}{_size(facets)} · {origin} · read by {', '.join(facets['consumedBy'])} · {status}")
        if "baseModel" in facets:
            base = facets["baseModel"]
            lines.append(
                f"      base model: source={base.get('source', '?')} source_sha256={base.get('source_sha256', '?')} ({base['card']})"
            )
        if "modelCard" in facets:
            lines.append("      model card: " + ", ".join(f"{k}={v}" for k, v in facets["modelCard"].items()))
        if "preferenceData" in facets:
            pref = facets["preferenceData"]
            rows = f"{pref['rows']} rows ({pref['rowsSource']})" if pref["rows"] is not None else "row count unknown"
            verdict = pref["validation"]["success"]
            gx = "passed" if verdict is True else "FAILED" if verdict is False else "no verdict found"
            lines.append(f"      preference data: {rows}; Great Expectations: {gx} ({pref['validation']['summary']})")

    lines.append("")
    lines.append(f"Metrics (stage {job['name']})")
    if not run["metrics"]:
        lines.append("  (none declared)")
    for metric_path, values in run["metrics"].items():
        lines.append(f"  {metric_path}: {json.dumps(values, sort_keys=True, default=str)}")
    for metric_path, values in run["upstreamMetrics"].items():
        lines.append(f"  upstream {metric_path}: {json.dumps(values, sort_keys=True, default=str)}")

    env = run["environment"]
    lines.append("")
    lines.append("Environment")
    lines.append("  " + ", ".join(f"{p} {env[p]}" for p in PACKAGES) + f", python {env['python']}")
    lines.append(f"  device {env['device']} ({env['deviceSource']})")
    return "\n".join(lines)


def lineage_cli(path: str, as_json: bool = False) -> int:
    event = build_lineage(path)
    if as_json:
        print(json.dumps(event, indent=2, default=str))
    else:
        print(render_text(event))
    return 0
