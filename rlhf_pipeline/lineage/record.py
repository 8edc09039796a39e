"""What DVC records about an artifact, read through ``dvc.repo.Repo``: the stage that produced it,
the stages upstream of it in DVC's graph, and how each recorded entry (a dep, an out, a params
file) compares with the workspace."""

from __future__ import annotations

import datetime as dt
import json
import os
import posixpath
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from rlhf_pipeline.errors import PipelineError, SettingsError, plain, quoted
from rlhf_pipeline.gitrepo import git, resolve_rev
from rlhf_pipeline.paths import DVC_LOCK, DVC_LOCK_COPY

# DVC's words for an entry that differs from the lock -> the report's
STATUS_WORDS = {"deleted": "missing", "new": "unknown"}


def lock_problem(root: str) -> str | None:
    """Why DVC cannot read ``root``/dvc.lock (its YAML parser and lock-file schema); None when it
    can, or when there is none yet."""
    from dvc.dvcfile import Lockfile
    from dvc.repo import Repo

    path = Path(root, DVC_LOCK)
    if not path.is_file():
        return None
    try:
        with Repo(root, uninitialized=True) as repo:
            Lockfile(repo, str(path)).load()
    except Exception as error:  # DVC raises a YAML syntax error or a schema error
        return " ".join(str(error).split())
    return None


def revision(repo) -> str | None:
    """The commit a repo opened at a git revision reads (``Repo(root, rev=...)``); None for the workspace.

    At a revision every entry is as that commit's dvc.lock recorded it: nothing is compared with
    the workspace, files inside outputs are read from DVC's cache (``repo.dvcfs``)."""
    from dvc.fs import GitFileSystem

    return repo.fs.rev if isinstance(repo.fs, GitFileSystem) else None


def project_root(repo) -> str:
    """The project's folder on disk (a repo opened at a revision has ``/`` as its root_dir)."""
    return repo.scm.root_dir if revision(repo) else repo.root_dir


def read_text(repo, path: str) -> str | None:
    """A file of the project as the repo sees it: the workspace's, or (at a revision) git's or
    DVC's cache's at that commit; None when it is not there."""
    try:
        if revision(repo):
            with repo.dvcfs.open(path, "r") as handle:
                return handle.read()
        return Path(repo.root_dir, path).read_text(errors="replace")
    except Exception:  # not there: no such file, not text, or (DVC) an object missing from the cache
        return None


def open_repo(path: str | os.PathLike, rev: str | None = None):
    """The DVC repo holding ``path`` and ``path`` relative to its root (a ``.dvc`` file stands for what it tracks);
    at git revision ``rev`` (nothing is checked out: DVC reads that commit's files through git) when given."""
    from dvc.exceptions import NotDvcRepoError
    from dvc.repo import Repo
    from dvc.scm import SCMError

    absolute = Path(os.path.abspath(path))
    existing = next(p for p in (absolute, *absolute.parents) if p.exists())
    try:
        root = Repo.find_root(str(existing if existing.is_dir() else existing.parent))
    except NotDvcRepoError:
        raise PipelineError(
            f"{path} is not inside a DVC repository: no .dvc/ directory in {absolute.parent} or any parent. "
            "Run `rlhf lineage` from the project (where `dvc init` was run) on an artifact the pipeline produced."
        ) from None
    rel = Path(os.path.relpath(absolute, root)).as_posix()
    if rel == ".." or rel.startswith("../"):
        raise SettingsError(f"{quoted(str(path))} is outside the DVC repository at {root}; nothing was read.")
    if not rev and (problem := lock_problem(root)):
        raise PipelineError(
            f"{Path(root, DVC_LOCK)} cannot be read by DVC ({problem}): a dvc command was probably killed while "
            f"rewriting it. Restore the last committed one with `git checkout -- {DVC_LOCK}` (or the retrain "
            f"flow's copy: `cp {DVC_LOCK_COPY} {DVC_LOCK}`), then `dvc repro`: the stages recorded "
            "since rerun, or come back from DVC's run cache."
        )
    try:
        repo = Repo(root, rev=resolve_rev(root, rev)) if rev else Repo(root)
    except SCMError:  # DVC outside git (its config not saying so): read what DVC has, git facts stay empty
        if rev:
            raise PipelineError(f"--rev {rev}: {root} is not a git repository, so it has no revisions.") from None
        repo = Repo(root, uninitialized=True)
    tracker = next((s for s in repo.index.stages if s.is_data_source and s.path_in_repo == rel), None)
    return repo, (repo_path(repo, tracker.outs[0]) if tracker else rel)


def repo_path(repo, entry) -> str:
    """An out's or dep's path relative to the repo root, with forward slashes."""
    return Path(os.path.relpath(entry.fs_path, repo.root_dir)).as_posix()


def is_under(path: str, parent: str) -> bool:
    return parent in ("", ".") or path == parent or path.startswith(parent.rstrip("/") + "/")


def producer_of(repo, rel: str):
    """(stage, out) whose output is ``rel`` or contains it; None when no stage or .dvc file wrote it."""
    found = [(stage, out) for stage in repo.index.stages for out in stage.outs if is_under(rel, repo_path(repo, out))]
    return max(found, key=lambda pair: len(repo_path(repo, pair[1])), default=None)


def upstream_stages(repo, stage) -> list:
    """``stage``, then every pipeline stage it depends on, breadth first through DVC's stage graph
    (``.dvc`` files are sources: the inputs they track name them)."""
    import networkx as nx

    return [s for s in nx.bfs_tree(repo.index.graph, stage) if s is stage or not s.is_data_source]


def stage_name(stage) -> str:
    """How ``dvc repro`` names the stage from the repo root: ``NAME``, ``sub/dvc.yaml:NAME`` or ``FILE.dvc``
    (DVC's own ``addressing`` is relative to the current directory)."""
    if stage.is_data_source:
        return stage.path_in_repo
    return stage.name if stage.path_in_repo == "dvc.yaml" else f"{stage.path_in_repo}:{stage.name}"


def record_file(stage) -> str:
    """The file that records a stage's hashes: the ``dvc.lock`` beside its ``dvc.yaml``, or its ``.dvc`` file."""
    directory = posixpath.dirname(stage.path_in_repo)
    return stage.path_in_repo if stage.is_data_source else posixpath.join(directory, "dvc.lock")


def command(stage) -> str | None:
    return " && ".join(stage.cmd) if isinstance(stage.cmd, list) else stage.cmd


def params_deps(stage) -> list:
    from dvc.dependency.param import ParamsDependency

    return [dep for dep in stage.deps if isinstance(dep, ParamsDependency)]


def file_deps(stage) -> list:
    from dvc.dependency.param import ParamsDependency

    return [dep for dep in stage.deps if not isinstance(dep, ParamsDependency)]


def params_used(repo, stage) -> dict[str, Any]:
    """The params ``dvc.lock`` recorded for the stage, as flat ``key: value`` leaves."""
    from dvc.utils.flatten import flatten

    return {
        _param_label(repo_path(repo, dep), key): value
        for dep in params_deps(stage)
        for key, value in flatten(dep.hash_info.value or {}).items()
    }


def params_changed(repo, stage) -> dict[str, dict[str, Any]]:
    """``{key: {"old", "new"}}`` for each recorded param whose value differs now (DVC's params diff)."""
    return {key: change for dep in params_deps(stage) for key, change in file_params_changed(repo, dep).items()}


def file_params_changed(repo, dep) -> dict[str, dict[str, Any]]:
    """:func:`params_changed` for one params file (``dep``, a params dependency)."""
    from dvc.utils.diff import diff

    if revision(repo):  # a revision's record is what it is: `rlhf lineage --diff` compares two
        return {}
    name = repo_path(repo, dep)
    current = {"data": dep.read_params() if Path(dep.fs_path).is_file() else {}}
    changes = diff({name: {"data": dep.hash_info.value or {}}}, {name: current}).get(name, {})
    return {_param_label(name, key): {"old": c["old"], "new": c["new"]} for key, c in changes.items()}


def _param_label(params_file: str, key: str) -> str:
    return key if params_file == "params.yaml" else f"{params_file}:{key}"


def _recorded_tree(out):
    """The directory tree DVC cached for ``out`` (None for a file, or when the tree is not in the cache)."""
    return out.get_obj() if out.hash_info and out.hash_info.isdir else None


def _workspace_tree(out, fs_path: str):
    """DVC's hash object for what is at ``fs_path`` now, hashed as DVC hashes it (None when nothing is there)."""
    from dvc_data.hashfile.build import build

    return build(out.cache, fs_path, out.fs, out.hash_name, ignore=out.dvcignore)[2] if Path(fs_path).exists() else None


def changed_files(repo, out) -> dict[str, list[str]] | None:
    """For a directory that differs from its lock: the files modified, added and deleted against the
    tree DVC cached for it (None when that tree is not in the cache)."""
    from dvc_data.hashfile.diff import diff

    recorded = _recorded_tree(out)
    if recorded is None or not Path(out.fs_path).is_dir():
        return None
    changes, base = diff(recorded, _workspace_tree(out, out.fs_path), out.cache), repo_path(repo, out)

    def paths(items, side):
        return sorted(posixpath.join(base, *getattr(c, side).key) for c in items if any(getattr(c, side).key))

    return {
        "modified": paths(changes.modified, "old"),
        "added": paths(changes.added, "new"),
        "deleted": paths(changes.deleted, "old"),
    }


def entry_check(repo, entry) -> dict[str, Any]:
    """How an out or file dep compares with ``dvc.lock``: status ok / modified / missing / unknown."""
    locked = entry.hash_info.value if entry.hash_info else None
    result: dict[str, Any] = {"path": repo_path(repo, entry), "locked": locked, "workspace": locked, "status": "ok"}
    if revision(repo):
        result.update(workspace=None, status="recorded")
    elif not entry.exists:
        result.update(workspace=None, status="missing")
    elif not locked:
        result.update(workspace=entry.get_hash().value, status="unknown")
    elif status := entry.status():
        result["status"] = STATUS_WORDS.get(word := next(iter(status.values())), word)
        if result["status"] == "modified":
            result.update(workspace=entry.get_hash().value, files=changed_files(repo, entry))
    return result


def inner_file_check(repo, out, rel: str) -> dict[str, Any]:
    """The check of ``rel``, a file or folder inside the directory output ``out``."""
    recorded, locked = _recorded_tree(out), None
    if recorded is not None:
        key = tuple(Path(rel).relative_to(repo_path(repo, out)).parts)
        found = recorded.get(key)  # a file; a folder is a subtree, hashed as DVC hashes directories
        subtree = None if found else recorded.get_obj(out.cache, key)
        locked = found[1].value if found else subtree.hash_info.value if subtree else None
    if revision(repo):
        return {"locked": locked, "workspace": None, "status": "recorded"}
    current = _workspace_tree(out, str(Path(repo.root_dir, rel)))
    current = current.hash_info.value if current is not None else None
    if recorded is None:
        status = entry_check(repo, out)["status"]
    elif current == locked:
        status = "ok"
    else:
        status = "missing" if current is None else "untracked" if locked is None else "modified"
    return {"locked": locked, "workspace": current, "status": status}


def stage_reasons(repo, stage) -> list[str]:
    """Why ``dvc repro`` would run the stage again, from DVC's own stage status (none at a revision)."""
    if revision(repo):
        return []
    reasons = []
    for item in next(iter(stage.status().values()), []):
        if isinstance(item, str):
            reasons.append(item.replace("changed command", "command changed in dvc.yaml"))
            continue
        for kind, entries in item.items():
            for path, status in entries.items():
                entry = next(e for e in [*stage.deps, *stage.outs] if e.def_path == path)
                if isinstance(status, dict):  # a params file: one reason per changed value in it
                    changed = file_params_changed(repo, entry)
                    reasons += [f"param {k} changed: {show(c['old'])} -> {show(c['new'])}" for k, c in changed.items()]
                    continue
                check = entry_check(repo, entry)
                word = "dep" if kind == "changed deps" else "out"
                reasons.append(f"{word} {check['path']} {check['status']}{files_note(check)}")
    return reasons


def files_note(check: dict) -> str:
    parts = [
        f"{label} {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
        for label, names in (check.get("files") or {}).items()
        if names
    ]
    return f" ({'; '.join(parts)})" if parts else ""


def show(value: Any) -> str:
    return "(unset)" if value is None else value if isinstance(value, str) else json.dumps(value, default=str)


def _iso(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def produced_at(stage) -> tuple[str, str]:
    """When the stage run that wrote ``stage``'s outputs finished (ISO 8601 in UTC), and what dates it:
    ``outputs``, the newest modification time among the files of its outputs in DVC's cache (a .dvc
    file's: the tracked data's); where none is in the workspace (a fresh clone), ``commit <sha>``, the commit that last
    recorded the stage's record file, when that file is as committed; else ``record file``, its own time.

    The artifact is the evidence: the time a lineage report is asked for says nothing about the run, nor
    does the time a clone wrote the record file. At a revision (no files on disk), the commit's time."""
    root = project_root(stage.repo)
    if rev := revision(stage.repo):
        committed = git(root, "log", "-1", "--format=%ct", rev)
        return _iso(int(committed or 0)), f"commit {rev}"
    times = []
    for out in stage.outs:
        if not out.use_cache:  # a file git keeps (metrics): a clone writes it, the run's time is the commit's
            continue
        top = Path(out.fs_path)
        if top.is_dir():
            times += [f.stat().st_mtime for f in top.rglob("*") if f.is_file()]
        elif top.is_file():
            times.append(top.stat().st_mtime)
    if times:
        return _iso(max(times)), "outputs"
    recorded_in = record_file(stage)
    if not git(root, "status", "--porcelain", "--", recorded_in):  # as committed (or git is not there)
        committed = git(root, "log", "-1", "--format=%ct %h", "--", recorded_in)
        if committed:
            seconds, sha = committed.split()
            return _iso(int(seconds)), f"commit {sha}"
    if Path(stage.path).is_file():
        return _iso(Path(stage.path).stat().st_mtime), "record file"
    return _iso(0), "record file"


def shareable_remote(remote: str | None) -> str | None:
    """``remote`` as a URI another machine can use, without credentials; None for a local path.

    An scp-style remote (``git@host:org/repo``) becomes ``ssh://git@host/org/repo``; a password or token
    in an http(s) URL is dropped; a remote that is a path or ``file://`` URI names this machine only."""
    if not remote:
        return None
    if "://" not in remote:
        user_host, colon, path = remote.partition(":")
        if not colon or "/" in user_host or not path or len(user_host) == 1:  # a path (or C:\ on Windows)
            return None
        return f"ssh://{user_host}/{path.lstrip('/')}"
    parsed = urlsplit(remote)
    if parsed.scheme == "file" or not parsed.hostname:
        return None
    host = parsed.hostname + (f":{parsed.port}" if parsed.port else "")
    if parsed.scheme == "ssh" and parsed.username:
        host = f"{parsed.username}@{host}"
    return urlunsplit((parsed.scheme, host, parsed.path, "", ""))


def remote_namespace(uri: str) -> str:
    """The OpenLineage namespace of a project whose git remote is ``uri``: the same for every clone."""
    parsed = urlsplit(uri)
    path = parsed.path.rstrip("/").removesuffix(".git")
    return f"dvc://{parsed.hostname}{path}"


def git_facts(root: str, recorded_in: str, params_files: list[str], rev: str | None = None) -> dict[str, Any]:
    """The last commit that changed the lock (or .dvc) file, and whether the tree moved on since
    (at revision ``rev``: the last such commit up to ``rev``, and the revision itself).

    ``url`` is the origin remote as a shareable URI, or None: a local path is never reported."""
    if rev is not None:
        return {
            "recordFile": recorded_in,
            "commit": git(root, "log", "-1", "--format=%H", rev, "--", recorded_in) or None,
            "revision": rev,
            "committedAt": git(root, "log", "-1", "--format=%cI", rev),
            "url": shareable_remote(git(root, "config", "--get", "remote.origin.url")),
            "dirty": False,
            "note": "read at a git revision: nothing was compared with the workspace",
        }
    if git(root, "rev-parse", "--is-inside-work-tree") is None:
        return {
            "recordFile": recorded_in,
            "commit": None,
            "dirty": None,
            "note": "the project is not in a git work tree",
        }
    status = git(root, "status", "--porcelain", "--untracked-files=no") or ""
    facts: dict[str, Any] = {
        "recordFile": recorded_in,
        "commit": git(root, "log", "-1", "--format=%H", "--", recorded_in) or None,
        "head": git(root, "rev-parse", "HEAD"),
        "url": shareable_remote(git(root, "config", "--get", "remote.origin.url")),
        "dirtyFiles": sorted({line[3:].split(" -> ")[-1].strip('"') for line in status.splitlines() if len(line) > 3}),
    }
    if facts["commit"] is None:
        return {**facts, "dirty": True, "note": f"{recorded_in} has never been committed"}
    facts["committedAt"] = git(root, "log", "-1", "--format=%cI", facts["commit"])
    changed = (git(root, "diff", "--name-only", facts["commit"], "--", recorded_in, *params_files) or "").splitlines()
    # a params file that commit never had counts as changed, not as clean
    changed += [
        f for f in params_files if f not in changed and git(root, "cat-file", "-e", f"{facts['commit']}:{f}") is None
    ]
    return {**facts, "changedSinceCommit": sorted(changed), "dirty": bool(changed or facts["dirtyFiles"])}


def not_produced_message(repo, path: str, rel: str) -> str:
    """Why ``path`` has no lineage, and what to ask for instead."""
    outs = [(stage, repo_path(repo, out)) for stage in repo.index.stages for out in stage.outs]
    inside = sorted(f"{out} ({stage_name(stage)})" for stage, out in outs if is_under(out, rel) and out != rel)
    readers = [stage_name(s) for s in repo.index.stages if any(is_under(rel, repo_path(repo, d)) for d in file_deps(s))]
    if inside and rel not in ("", "."):
        listed = f"{', '.join(inside[:8])}{' ...' if len(inside) > 8 else ''}"
        hint = f"it contains outputs: {listed}. Run `rlhf lineage` on one of those."
    elif readers:
        hint = (
            f"it is a plain source that stage(s) {', '.join(readers)} read. Ask for the lineage of one of their "
            f"outputs instead, or track it with `dvc add {rel}`."
        )
    else:
        hint = (
            "no output in dvc.lock is or contains it. Check the path (it is resolved from the current directory), "
            "or run `dvc repro` if the stage that should write it has not run yet."
        )
    return f"{plain(path, 200)} is not produced by any DVC stage (nor tracked by a .dvc file): {hint}"
