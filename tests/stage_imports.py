"""Which project files a stage runs: its script and every project module it imports, transitively.

Static analysis (``ast``): every ``import``/``from ... import`` anywhere in a module counts,
including imports inside functions (they run when the function is called), except those under
``if TYPE_CHECKING:``. Importing ``pkg.mod`` also runs ``pkg/__init__.py``. Used by the tests
that keep ``dvc.yaml``'s code dependencies exact.
"""

from __future__ import annotations

import ast
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROJECT_PACKAGES = ("rlhf_pipeline",)


def module_path(name: str, root: Path = REPO) -> Path | None:
    """The file of project module ``name`` (``a.b`` -> a/b.py or a/b/__init__.py), or None."""
    if name.split(".")[0] not in PROJECT_PACKAGES:
        return None
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _package_of(path: Path, root: Path) -> str:
    """The package a module file belongs to (what a level-1 relative import is relative to)."""
    return ".".join(path.relative_to(root).parts[:-1])


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported_modules(path: Path, root: Path = REPO) -> set[str]:
    """Dotted names of the modules ``path`` imports (``from pkg import mod`` gives ``pkg.mod``
    when ``mod`` is a module, else ``pkg``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = {
        id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node) for n in ast.walk(node)
    }
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                package = _package_of(path, root).split(".")
                package = package[: len(package) - node.level + 1]
                module = ".".join([*package, module] if module else package)
            names.add(module)
            names.update(
                f"{module}.{alias.name}" for alias in node.names if module_path(f"{module}.{alias.name}", root)
            )
    return names


def _with_parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def project_files(script: Path, root: Path = REPO) -> dict[str, str]:
    """Project files that running ``script`` imports, relative to ``root``: ``{file: importer}``
    (the script maps to itself), so a failure can say how a file is reached. A module beside the
    script (``stages/_interpreter.py``) counts too: Python puts a script's folder first on sys.path."""
    script = script.resolve()
    found = {script.relative_to(root).as_posix(): script.relative_to(root).as_posix()}
    queue = [script]
    while queue:
        current = queue.pop()
        importer = current.relative_to(root).as_posix()
        for name in sorted(imported_modules(current, root)):
            beside = script.parent / f"{name}.py"
            if "." not in name and beside.is_file() and beside.relative_to(root).as_posix() not in found:
                found[beside.relative_to(root).as_posix()] = importer
                queue.append(beside)
            for module in _with_parents(name):
                path = module_path(module, root)
                if path is None:
                    continue
                relative = path.relative_to(root).as_posix()
                if relative not in found:
                    found[relative] = importer
                    queue.append(path)
    return found


def import_chain(found: dict[str, str], file: str) -> str:
    """``script -> module -> ... -> file`` from the map :func:`project_files` returns."""
    chain = [file]
    while found[chain[-1]] != chain[-1]:
        chain.append(found[chain[-1]])
    return " -> ".join(reversed(chain))


def pipeline_stages(root: Path = REPO):
    """The stages of ``root``/dvc.yaml, as DVC reads them."""
    from dvc.repo import Repo

    with Repo(str(root), uninitialized=True) as repo:
        return list(repo.index.stages)


def stage_script(stage) -> str:
    scripts = [word for word in shlex.split(stage.cmd) if word.endswith(".py")]
    assert len(scripts) == 1, f"stage {stage.name}: cannot tell its script from cmd {stage.cmd!r}"
    return scripts[0]


def stage_schema(stage):
    """The params schema the stage's script hands the runner (its module-level ``Params``)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(f"stage_{stage.name}", REPO / stage_script(stage))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves the schema's annotations through it
    spec.loader.exec_module(module)
    return module.Params


def stage_importers(module: str) -> set[str]:
    """The stages whose script imports ``module`` (a path like rlhf_pipeline/models.py)."""
    return {stage.name for stage in pipeline_stages() if module in project_files(REPO / stage_script(stage))}
