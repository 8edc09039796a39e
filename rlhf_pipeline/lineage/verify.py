"""``rlhf lineage --verify PATH``: is every byte of an artifact the one ``dvc.lock`` recorded?

DVC itself decides "unchanged" from its state database (a file's size, mtime and inode) and never
re-reads the bytes of an object already in its cache: a bit flipped in a workspace file with its
mtime kept, or in a cache object, goes unnoticed by ``dvc status``, is checked out again by
``dvc repro`` and is uploaded under its old hash by ``dvc push``. This check reads the bytes: each
file of the artifact is hashed afresh (md5, DVC 3's hash) and compared with the hash its ``.dir``
object in the cache (or ``dvc.lock`` itself, for a single file) records, and so is each file's
object in the DVC cache; a directory's ``.dir`` object is re-digested as DVC digests it.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
from pathlib import Path

from rlhf_pipeline.errors import DamagedArtifactError, PipelineError, SettingsError
from rlhf_pipeline.lineage import record


def md5_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def tree_md5(folder: str | os.PathLike) -> str:
    """The hash DVC records for ``folder`` as a directory output (``<md5>.dir``: the digest of its
    files' relative paths and md5s), computed afresh from the bytes."""
    from dvc_data.hashfile.hash_info import HashInfo
    from dvc_data.hashfile.meta import Meta
    from dvc_data.hashfile.tree import Tree

    folder = Path(folder)
    tree = Tree()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        tree.add(tuple(path.relative_to(folder).parts), Meta(size=path.stat().st_size), HashInfo("md5", md5_file(path)))
    tree.digest()
    return tree.hash_info.value


def _recorded_files(out) -> tuple[dict[str, str], list[str]]:
    """``{path inside the output: md5}`` as DVC recorded them ({"": md5} for a file output), and
    what is wrong with the record itself (a directory's .dir object missing from the cache or damaged)."""
    from dvc_data.hashfile.tree import Tree

    locked = out.hash_info.value
    if not out.hash_info.isdir:
        return {"": locked}, []
    where = out.cache.oid_to_path(locked)
    if not Path(where).is_file():
        return {}, [f"its file list (the .dir object {locked}) is not in the DVC cache ({where})"]
    try:
        tree = Tree.load(out.cache, out.hash_info)
        files = {"/".join(key): hash_info.value for key, _, hash_info in tree}
        tree.digest()
    except Exception as error:  # a damaged .dir object fails to parse in several ways
        return {}, [f"its file list (the .dir object {where}) is damaged: {type(error).__name__}: {error}"]
    if tree.hash_info.value != locked:
        return files, [f"its file list (the .dir object {where}) is damaged: it digests to {tree.hash_info.value}"]
    return files, []


def verify_output(repo, out, inside: str = "", workspace: bool = True) -> tuple[int, list[str]]:
    """(files checked, one line per mismatch) for the output ``out``, or only the part ``inside``
    it (a path relative to the output); ``workspace`` false: its DVC cache objects only."""
    base = record.repo_path(repo, out)
    if not out.hash_info or not out.hash_info.value:
        return 0, [f"{base}: dvc.lock records no hash for it (run `dvc repro` to record one)"]
    recorded, record_problems = _recorded_files(out)
    problems = [f"{base}: {problem}" for problem in record_problems]
    prefix = inside.strip("/")
    wanted = {k: v for k, v in recorded.items() if not prefix or k == prefix or k.startswith(prefix + "/")}
    root = Path(repo.root_dir, base)
    for key, md5 in sorted(wanted.items()):
        name = posixpath.join(base, key) if key else base
        path = root / key if key else root
        if not workspace:
            pass
        elif not path.is_file():
            problems.append(f"{name}: missing from the workspace (dvc.lock records md5 {md5})")
        elif (found := md5_file(path)) != md5:
            problems.append(f"{name}: the workspace copy has md5 {found}, dvc.lock records {md5}")
        if out.use_cache:
            cached = Path(out.cache.oid_to_path(md5))
            if not cached.is_file():
                problems.append(f"{name}: md5 {md5} is not in the DVC cache ({cached})")
            elif (found := md5_file(cached)) != md5:
                problems.append(f"{name}: the DVC cache object {cached} is damaged (its bytes hash to {found})")
    if workspace and out.hash_info.isdir and root.is_dir() and not record_problems:
        scope = root / prefix if prefix else root
        present = {p.relative_to(root).as_posix() for p in scope.rglob("*") if p.is_file()} if scope.is_dir() else set()
        problems += [f"{posixpath.join(base, k)}: not in the recorded output" for k in sorted(present - set(recorded))]
    return len(wanted), problems


def verify_paths(path: str | os.PathLike) -> tuple[int, list[str]]:
    """(files checked, mismatches) for the DVC-tracked artifact at ``path``, or for every stage
    output and ``.dvc``-tracked file when ``path`` is the project root."""
    repo, rel = record.open_repo(path)
    if rel in ("", "."):
        outs = [(out, "") for stage in repo.index.stages for out in stage.outs]
    else:
        found = record.producer_of(repo, rel)
        if found is None:
            raise SettingsError(record.not_produced_message(repo, str(path), rel))
        out, base = found[1], record.repo_path(repo, found[1])
        outs = [(out, "" if rel == base else posixpath.relpath(rel, base))]
    checked, problems = 0, []
    for out, inside in outs:
        count, found_problems = verify_output(repo, out, inside)
        checked, problems = checked + count, problems + found_problems
    return checked, problems


RESTORE_ADVICE = (
    "A damaged workspace copy comes back from a good cache object with `dvc checkout --force PATH`; a damaged cache "
    "object must be deleted (the path above) and its output rebuilt with `dvc repro --force STAGE`, or fetched "
    "again with `dvc pull --force` from a remote holding a good copy."
)


def _pipeline_stage(repo, stage: str):
    found = next((s for s in repo.index.stages if not s.is_data_source and record.stage_name(s) == stage), None)
    if found is None:
        raise PipelineError(f"no stage named {stage!r} in {repo.root_dir}/dvc.yaml")
    return found


def stage_output_problems(path: str | os.PathLike, stage: str) -> tuple[int, list[str]]:
    """(files checked, mismatches) of ``stage``'s recorded outputs, workspace and DVC cache: after a
    run or a restore from DVC's run cache, what dvc.lock now records is what is there."""
    repo, _ = record.open_repo(path)
    checked, problems = 0, []
    for out in _pipeline_stage(repo, stage).outs:
        count, found_problems = verify_output(repo, out)
        checked, problems = checked + count, problems + found_problems
    return checked, problems


def stage_input_problems(path: str | os.PathLike, stage: str) -> tuple[int, list[str]]:
    """(files checked, mismatches) of what a ``dvc repro`` of ``stage`` would read or restore, re-read:
    each dependency another stage produced (workspace and DVC cache, against dvc.lock), and the
    DVC cache objects of the stage's own recorded outputs, which a checkout or a run-cache restore
    lays down as they are. A stage whose outputs are not recorded yet has nothing of its own to check."""
    repo, _ = record.open_repo(path)
    target = _pipeline_stage(repo, stage)
    pipeline = [s for s in repo.index.stages if not s.is_data_source]
    produced = {record.repo_path(repo, out): out for s in pipeline if s is not target for out in s.outs}
    checks = []
    for dep in target.deps:
        rel = record.repo_path(repo, dep)
        found = [(base, out) for base, out in produced.items() if record.is_under(rel, base)]
        if found:
            base, out = max(found, key=lambda pair: len(pair[0]))
            checks.append((out, "" if rel == base else posixpath.relpath(rel, base), True))
    checks += [(out, "", False) for out in target.outs]
    checked, problems = 0, []
    for out, inside, workspace in checks:
        if not out.hash_info or not out.hash_info.value:
            continue  # not recorded yet: DVC itself refuses a missing dependency
        count, found_problems = verify_output(repo, out, inside, workspace)
        checked, problems = checked + count, problems + found_problems
    return checked, problems


def verify_cli(path: str) -> int:
    """Print ``ok`` or each mismatch; exit 0, or :class:`DamagedArtifactError`'s code."""
    checked, problems = verify_paths(path)
    if not problems:
        print(f"ok: {checked} file(s) of {path} match dvc.lock, and so do their DVC cache objects (bytes re-read)")
        return 0
    listed = "\n".join(f"- {p}" for p in problems)
    raise DamagedArtifactError(
        f"{path}: {len(problems)} mismatch(es) in {checked} file(s) checked against dvc.lock and the DVC cache:\n"
        f"{listed}\n{RESTORE_ADVICE}"
    )
