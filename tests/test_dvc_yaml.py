"""dvc.yaml declares exactly what each stage reads: its code (derived here from the imports) and
its params (enforced at run time by the stage runner's restricted view)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import run_stage_script
from stage_imports import (
    REPO,
    import_chain,
    imported_modules,
    module_path,
    pipeline_stages,
    project_files,
    stage_importers,
    stage_schema,
    stage_script,
)

from rlhf_pipeline.params import StageParams
from rlhf_pipeline.params.ppo import PPOParams
from rlhf_pipeline.params.schema import Params
from rlhf_pipeline.runner import DeclaredParams, UndeclaredParamError, declared_param_keys, run_stage


class ProbeParams(StageParams):
    ppo: PPOParams = PPOParams()


CODE_FOLDERS = ("rlhf_pipeline", "stages")


def code_deps(stage) -> set[str]:
    """The declared dependencies that are project code (files or folders under rlhf_pipeline/ or stages/)."""
    from dvc.dependency.param import ParamsDependency

    paths = {dep.def_path for dep in stage.deps if not isinstance(dep, ParamsDependency)}
    return {p.rstrip("/") for p in paths if p.split("/")[0] in CODE_FOLDERS}


# --------------------------------------------------------------------------------------------
# code
# --------------------------------------------------------------------------------------------
def test_each_stage_depends_on_exactly_the_project_files_it_runs():
    problems = []
    for stage in pipeline_stages():
        imported = project_files(REPO / stage_script(stage))
        declared = code_deps(stage)
        folders = {d for d in declared if (REPO / d).is_dir()}
        covered = {f for f in imported if f in declared or any(f.startswith(d + "/") for d in folders)}
        for file in sorted(set(imported) - covered):
            problems.append(f"stage {stage.name}: dvc.yaml does not declare {file} ({import_chain(imported, file)})")
        for file in sorted(declared - folders - set(imported)):
            problems.append(
                f"stage {stage.name}: dvc.yaml declares {file}, which the stage never imports (a needless rerun)"
            )
    assert not problems, "\n".join(problems)


def test_the_import_analysis_sees_lazy_and_from_imports(tmp_path):
    package = tmp_path / "rlhf_pipeline"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from rlhf_pipeline import b\n")
    (package / "b.py").write_text("from rlhf_pipeline.c import thing\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rlhf_pipeline import d\nthing = 1\n"
    )
    (package / "d.py").write_text("")
    (tmp_path / "script.py").write_text("import rlhf_pipeline.a\n")
    found = project_files(tmp_path / "script.py", tmp_path)
    assert set(found) == {
        "script.py",
        "rlhf_pipeline/__init__.py",
        "rlhf_pipeline/a.py",
        "rlhf_pipeline/b.py",
        "rlhf_pipeline/c.py",
    }
    assert (
        import_chain(found, "rlhf_pipeline/c.py")
        == "script.py -> rlhf_pipeline/a.py -> rlhf_pipeline/b.py -> rlhf_pipeline/c.py"
    )


def test_every_stage_script_is_a_dvc_stage():
    """Every script in stages/ is a stage (stages/_interpreter.py is their shared first import)."""
    scripts = {stage_script(stage) for stage in pipeline_stages()}
    assert scripts == {f"stages/{p.name}" for p in (REPO / "stages").glob("[!_]*.py")}


# --------------------------------------------------------------------------------------------
# params: what DVC declares, and the view the runner hands a stage
# --------------------------------------------------------------------------------------------
DVC_YAML = {
    "stages": {
        "keys": {"cmd": "true", "params": ["seed", "task", "data.queries.query_length", {"other.yaml": ["x"]}]},
        "whole": {"cmd": "true", "params": [{"params.yaml": None}]},
        "none": {"cmd": "true"},
    }
}


def test_declared_keys_are_read_through_dvc(tmp_path):
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(DVC_YAML))
    assert declared_param_keys("keys", tmp_path) == {"seed", "task", "data.queries.query_length"}
    assert declared_param_keys("whole", tmp_path) is None
    assert declared_param_keys("none", tmp_path) == frozenset()
    with pytest.raises(Exception, match="no stage named 'missing'"):
        declared_param_keys("missing", tmp_path)
    with pytest.raises(Exception, match="no dvc.yaml"):
        declared_param_keys("keys", tmp_path / "elsewhere")


def test_the_view_lets_through_declared_keys_only():
    params = Params.model_validate({"seed": 7, "data": {"queries": {"query_length": 12}}})
    view = DeclaredParams(params, {"seed", "task", "data.queries.query_length"}, "example")
    assert view.seed == 7
    assert view.task is params.task and view.task.model_dump() == params.task.model_dump()
    assert view.data.queries.query_length == 12
    with pytest.raises(UndeclaredParamError) as info:
        _ = view.data.queries.test_fraction
    message = str(info.value)
    assert (
        "stage example" in message and "'data.queries.test_fraction'" in message and "stages.example.params" in message
    )
    with pytest.raises(UndeclaredParamError, match="'ppo.lr'"):
        _ = view.ppo.lr
    with pytest.raises(UndeclaredParamError, match="'data.queries'"):
        view.data.queries.model_dump()  # would read test_fraction etc. too
    with pytest.raises(AttributeError):
        _ = view.data.no_such_section
    with pytest.raises(AttributeError):
        view.seed = 3
    assert view.reads == {"seed", "task", "data.queries.query_length"}
    assert view.declares("task.temperature") and not view.declares("data.queries")


def test_a_stage_reading_an_undeclared_key_fails_with_exit_2(tmp_path, monkeypatch, capsys):
    (tmp_path / "dvc.yaml").write_text(
        yaml.safe_dump({"stages": {"probe": {"cmd": "true", "params": ["seed", "ppo.lr"]}}})
    )
    (tmp_path / "params.yaml").write_text("seed: 5\nppo:\n  lr: 1.0e-5\n")
    monkeypatch.chdir(tmp_path)
    seen = []
    run_stage("probe", lambda params: seen.append((params.seed, params.ppo.lr)), ProbeParams, argv=[])
    assert seen == [(5, 1.0e-5)]
    with pytest.raises(SystemExit) as exit_:
        run_stage("probe", lambda params: params.ppo.cliprange, ProbeParams, argv=[])
    assert exit_.value.code == 2
    assert "stage probe read params.yaml key 'ppo.cliprange'" in capsys.readouterr().err


@pytest.mark.e2e
def test_a_real_stage_is_held_to_dvc_yaml(project, capsys):
    """The base_model stage with its `base_model` declaration removed from dvc.yaml stops at its first read."""
    dvc_yaml = yaml.safe_load((project / "dvc.yaml").read_text())
    dvc_yaml["stages"]["base_model"]["params"].remove("base_model")
    (project / "dvc.yaml").write_text(yaml.safe_dump(dvc_yaml))
    before = sorted(p.name for p in (project / "models").iterdir())
    assert run_stage_script("base_model") == 2
    err = capsys.readouterr().err
    assert "stage base_model read params.yaml key 'base_model.source'" in err and "Traceback" not in err
    assert sorted(p.name for p in (project / "models").iterdir()) == before


def parameter_paths(model, prefix: str = "") -> set[str]:
    """Every dotted key of a params model (sections and leaves)."""
    paths = set()
    for name in type(model).model_fields:
        paths.add(f"{prefix}{name}")
        value = getattr(model, name)
        if hasattr(type(value), "model_fields"):
            paths |= parameter_paths(value, f"{prefix}{name}.")
    return paths


def test_every_declared_key_is_a_parameter_of_the_stage_s_own_schema():
    """Every declared key names a real parameter (a typo in dvc.yaml would track nothing), in the
    sections the stage's own schema validates; and those sections are exactly the declared ones
    (a stage validating a section it does not read would depend on that section's module)."""
    every = parameter_paths(Params())
    for stage in pipeline_stages():
        keys = declared_param_keys(stage.name, REPO)
        assert keys is not None, f"stage {stage.name} declares the whole params file"
        assert keys <= every, f"stage {stage.name}: unknown keys {sorted(keys - every)}"
        schema = stage_schema(stage)
        assert keys <= parameter_paths(schema()), f"stage {stage.name}: its schema lacks {sorted(keys)}"
        sections = {key.split(".")[0] for key in keys} | {"seed"}
        assert set(schema.model_fields) == sections, f"stage {stage.name} validates {sorted(schema.model_fields)}"


# --------------------------------------------------------------------------------------------
# outputs
# --------------------------------------------------------------------------------------------
def test_every_output_reaches_a_clone():
    """A clone (or a `dvc exp` workspace) gets each output from git or from DVC's cache. An output
    with `cache: false` that git ignores exists in neither, so every fresh checkout reruns its stage
    (dvclive/ was such an output: each queued experiment retrained the reward model)."""
    import subprocess

    stranded = []
    for stage in pipeline_stages():
        for out in stage.outs:
            if out.use_cache:
                continue
            ignored = (
                subprocess.run(["git", "check-ignore", "-q", "--no-index", out.def_path], cwd=REPO).returncode == 0
            )
            if ignored:
                stranded.append(f"{stage.addressing}: {out.def_path}")
    assert not stranded, f"outputs with `cache: false` that .gitignore hides from git: {stranded}"


def test_a_stage_whose_declared_key_is_missing_from_the_file_fails_with_exit_2(tmp_path, monkeypatch, capsys):
    """DVC reads declared params from params.yaml itself; the schema's default would hide the gap
    until `dvc repro` fails after the stage ran."""
    (tmp_path / "dvc.yaml").write_text(
        yaml.safe_dump({"stages": {"probe": {"cmd": "true", "params": ["seed", "ppo.lr"]}}})
    )
    (tmp_path / "params.yaml").write_text("seed: 5\n")
    monkeypatch.chdir(tmp_path)
    ran = []
    with pytest.raises(SystemExit) as exit_:
        run_stage("probe", lambda params: ran.append(params.seed), ProbeParams, argv=[])
    assert exit_.value.code == 2 and not ran
    assert "ppo.lr: missing; dvc.yaml tracks it for stage probe" in capsys.readouterr().err


def test_the_code_hash_follows_the_declared_code(monkeypatch):
    """train_policy's checkpoint fingerprint includes this hash: editing any module the stage
    declares (here ppo.py, simulated) changes it, so an old checkpoint is not resumed."""
    import rlhf_pipeline.runner as runner

    before, base_before = runner.declared_code_hash("train_policy", REPO), runner.declared_code_hash("base_model", REPO)
    assert before == runner.declared_code_hash("train_policy", REPO)
    real = runner.sha256_file
    edited = "rlhf_pipeline/ppo/trainer.py"
    monkeypatch.setattr(runner, "sha256_file", lambda path: "edited" if str(path).endswith(edited) else real(path))
    assert runner.declared_code_hash("train_policy", REPO) != before
    assert runner.declared_code_hash("base_model", REPO) == base_before  # base_model does not import the trainer


def test_the_code_hash_reads_the_package_when_the_project_holds_no_copy(tmp_path):
    """A project run from an installed package (no rlhf_pipeline/ beside dvc.yaml) hashes the
    package's own files: the same hash as the checkout's, not a FileNotFoundError."""
    import shutil

    from rlhf_pipeline.runner import declared_code_hash

    shutil.copy(REPO / "dvc.yaml", tmp_path / "dvc.yaml")
    shutil.copytree(REPO / "stages", tmp_path / "stages")
    assert declared_code_hash("train_policy", tmp_path) == declared_code_hash("train_policy", REPO)


# --------------------------------------------------------------------------------------------
# layering: what an edit can stale
# --------------------------------------------------------------------------------------------
def library_modules() -> list[Path]:
    return sorted((REPO / "rlhf_pipeline").rglob("*.py"))


def test_the_library_has_no_import_cycle():
    """Low modules never import higher ones, so the graph of imports (lazy ones included) is a DAG:
    a cycle would tie every module on it to every stage that imports any of them."""
    import networkx as nx

    graph = nx.DiGraph()
    for path in library_modules():
        importer = path.relative_to(REPO).as_posix()
        for name in imported_modules(path):
            target = module_path(name)
            if target is not None and target != path:
                graph.add_edge(importer, target.relative_to(REPO).as_posix())
    cycles = list(nx.simple_cycles(graph))
    assert cycles == [], f"import cycles: {cycles[:3]}"


def test_no_module_imports_a_folder_that_stands_above_it_and_the_folders_make_no_circle():
    """A folder (ppo/, params/, preferences/, reward/, lineage/) stands at the floor of its highest module:
    what imports from it is on that floor or above (queries and conversations importing the contract's text
    rules from preferences/, which stands on floor 2, were the house's upward arrows: the rules now live at
    the library's base). And folded into folders, the imports between them make no circle."""
    import networkx as nx

    floor = {name: level for level, names in LIBRARY_FLOORS.items() for name in names.split()}
    modules = [(path, _library_name(path)) for path in library_modules()]
    folder_floor: dict[str, int] = {}
    for _, name in modules:
        if name is not None and "/" in name:
            folder = name.split("/")[0]
            folder_floor[folder] = max(folder_floor.get(folder, 0), floor[name])
    upward, graph = [], nx.DiGraph()
    for path, name in modules:
        if name is None:
            continue
        for imported in imported_modules(path):
            target = module_path(imported)
            other = _library_name(target) if target is not None and target != path else None
            if other is None or "/" not in other:
                continue
            folder, own = other.split("/")[0], name.split("/")[0] if "/" in name else None
            if folder != own and floor[name] < folder_floor[folder]:
                upward.append(
                    f"{name} (floor {floor[name]}) imports {other} from {folder}/ (floor {folder_floor[folder]})"
                )
            if own is not None and folder != own:
                graph.add_edge(own, folder)
    assert upward == [], f"imports from a folder above: {upward}"
    assert list(nx.simple_cycles(graph)) == [], f"circles between folders: {list(nx.simple_cycles(graph))[:3]}"


def test_a_first_party_import_inside_a_function_says_why():
    """An import inside a function hides a dependency from a reader of the module's head; each one
    carries its reason in a comment on its line or the line above (or is not first-party)."""
    import ast

    silent = []
    for path in library_modules():
        lines = path.read_text().splitlines()
        for function in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                if any(name.split(".")[0] == "rlhf_pipeline" for name in names) or getattr(node, "level", 0):
                    said = "#" in lines[node.lineno - 1] or lines[node.lineno - 2].strip().startswith("#")
                    if not said:
                        silent.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert silent == [], f"first-party imports inside functions without a reason: {silent}"


def test_the_base_model_stage_runs_only_the_bottom_of_the_library():
    """base_model's code dependencies: editing anything else in the library reruns nothing from
    the base model on. These modules (and the two package markers) are the floor: the runner and
    the params it validates, errors and atomic writes, the model card and the environment record
    it carries, the base-model sources, the admission of a user's model folder and the model
    helpers they use, the entry point's offline environment, the tokenizer's prefix the card
    records, and the check of the model-dependent values (fit.py, with the four schemas whose keys
    it checks: ppo, reward, data, task) as soon as the model is built, the CPU numerics it pins
    (numerics.py, params/compute.py) and the malloc settings it makes (allocator.py)."""
    found = {f for f in project_files(REPO / "stages/base_model.py") if f.startswith("rlhf_pipeline/")}
    assert found == {
        "rlhf_pipeline/__init__.py",
        "rlhf_pipeline/allocator.py",
        "rlhf_pipeline/environment.py",
        "rlhf_pipeline/errors.py",
        "rlhf_pipeline/fit.py",
        "rlhf_pipeline/io.py",
        "rlhf_pipeline/model_folder.py",
        "rlhf_pipeline/modelcard.py",
        "rlhf_pipeline/models.py",
        "rlhf_pipeline/numerics.py",
        "rlhf_pipeline/offline.py",
        "rlhf_pipeline/params/__init__.py",
        "rlhf_pipeline/params/base_model.py",
        "rlhf_pipeline/params/compute.py",
        "rlhf_pipeline/params/data.py",
        "rlhf_pipeline/params/ppo.py",
        "rlhf_pipeline/params/reward.py",
        "rlhf_pipeline/params/task.py",
        "rlhf_pipeline/paths.py",
        "rlhf_pipeline/runner.py",
        "rlhf_pipeline/sources.py",
        "rlhf_pipeline/tokens.py",
    }


@pytest.mark.parametrize(
    "module, stages",
    [  # the PPO maths, the PPO schema, the reward model: none reaches a stage upstream of its first reader
        ("rlhf_pipeline/ppo/advantages.py", {"train_policy"}),
        ("rlhf_pipeline/ppo/losses.py", {"train_policy"}),
        # evaluate: ppo.kl.estimator; base_model: freeze_layers and lora checked against the model it builds
        ("rlhf_pipeline/params/ppo.py", {"base_model", "train_policy", "evaluate"}),
        ("rlhf_pipeline/params/evaluate.py", {"evaluate"}),
        ("rlhf_pipeline/contract.py", {"validate_preferences"}),
        # the reward model's scoring and files are read by every stage after preferences; its training by one
        ("rlhf_pipeline/reward/model.py", {"train_reward", "normalize_reward", "train_policy", "evaluate"}),
        ("rlhf_pipeline/reward/persistence.py", {"train_reward", "normalize_reward", "train_policy", "evaluate"}),
        ("rlhf_pipeline/reward/training.py", {"train_reward"}),
        ("rlhf_pipeline/training.py", {"train_reward", "train_policy"}),
        ("rlhf_pipeline/distributed.py", {"train_reward", "train_policy"}),
        ("rlhf_pipeline/params/schema.py", set()),
        ("rlhf_pipeline/params/schedule.py", set()),
    ],
)
def test_a_module_is_code_of_the_stages_that_read_it_only(module, stages):
    assert stage_importers(module) == stages


def test_no_library_flow_or_stage_function_is_over_80_lines():
    """Each function does one thing a reader can hold: the trainers' loops included, the retrain flow
    and its command line, and each stage's main (validated params in, library calls, outputs written)."""
    import ast

    code = [*library_modules(), *sorted((REPO / "flows").rglob("*.py")), *sorted((REPO / "stages").glob("*.py"))]
    long = [
        f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in code
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 80
    ]
    assert long == []


def test_only_gitrepo_starts_git():
    """git has one home in the library (rlhf_pipeline/gitrepo.py): no other module builds a command
    line that starts with "git", so every user's revision passes its one check before git sees it."""
    import ast

    others = []
    for path in library_modules():
        if path.name == "gitrepo.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.List) and node.elts and isinstance(node.elts[0], ast.Constant):
                if node.elts[0].value == "git":
                    others.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert others == [], f"modules that run git themselves: {others}"


def test_the_registry_reads_git_below_the_lineage_records():
    """registry.py used to import lineage/record.py (the one upward arrow); both now read git below them."""
    for name in ("registry.py", "fetching.py"):
        imported = imported_modules(REPO / "rlhf_pipeline" / name)
        assert "rlhf_pipeline.gitrepo" in imported and "rlhf_pipeline.lineage.record" not in imported, name


def test_the_pipeline_s_paths_are_dvc_yaml_s():
    """rlhf_pipeline/paths.py is the code's one home for the pipeline's paths: each stage output it
    names is an output (or a metrics file) of dvc.yaml, or a folder of them or a file in one, and each
    user folder a dependency there."""
    import yaml

    from rlhf_pipeline import paths

    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    outs, deps = set(), set()
    for spec in stages.values():
        for out in [*spec.get("outs", []), *spec.get("metrics", []), *spec.get("plots", [])]:
            outs.add(next(iter(out)) if isinstance(out, dict) else out)
        deps.update(d.split("#")[0].strip() for d in spec.get("deps", []))
    top_metrics = set(yaml.safe_load((REPO / "dvc.yaml").read_text()).get("metrics", []))
    named = {k: v for k, v in vars(paths).items() if k.isupper() and isinstance(v, str)}
    user_folders = {paths.LOCAL_MODELS, paths.RAW_DATA, paths.LABELS}
    for lock in ("DVC_LOCK", "DVC_LOCK_COPY", "REQUIREMENTS_LOCK"):  # DVC's record and the packages' lock
        named.pop(lock)
    missing = [
        f"{name} = {path}"
        for name, path in named.items()
        if path not in user_folders
        and path not in outs | top_metrics
        and not any(path.startswith(f"{o}/") or o.startswith(f"{path}/") for o in outs)
    ]
    assert missing == [], f"paths.py names what no stage of dvc.yaml writes: {missing}"
    assert user_folders <= deps, user_folders - deps


# The library's floors, bottom up: a module imports only its own floor and those below it.
LIBRARY_FLOORS = {
    # maths on tensors, I/O, git, the pipeline's names: no model, no params
    0: "errors allocator io json_stream gitrepo paths metric_keys offline logging functional decoding optim progress "
    "numerics attention tokens model_folder saved_datasets arguments ppo/advantages ppo/kl ppo/losses text_rules "
    "redaction project_key file_lock project_files",
    # the params schema, section by section
    1: "params/__init__ params/base_model params/compute params/data params/evaluate params/labelling params/ppo "
    "params/promotion params/reward params/schedule params/task params/schema",
    # models, devices and data: loading, sampling, scoring, formats, the contract
    2: "devices distributed environment models modelcard fit runner sources conversations queries sampling "
    "static_sampling candidates labelers preferences/formats preferences/splits preferences/simulated "
    "preferences/export contract corpus datadocs plots_page reward/model reward/persistence reward/folder "
    "reward/normalization ppo/checkpoint ppo/stats ppo/kl_budget training",
    # training and evaluation
    3: "reward/training reward/adoption ppo/policy ppo/parts ppo/rollout ppo/trainer evaluation evaluation_report",
    # audit and commands: lineage, the registry and its gate, labelling with people, the CLI
    4: "lineage/record lineage/verify lineage/facts lineage/event lineage/render lineage/diff registry promotion "
    "fetching registry_listing judges gate label_studio/interface label_studio/client label_studio/export "
    "label_studio/tasks label_studio/importing side_by_side side_by_side_sampling commands/base commands/project "
    "commands/models commands/data commands/lineage commands/label cli",
}


def _library_name(path: Path) -> str | None:
    """``ppo/trainer`` for rlhf_pipeline/ppo/trainer.py; None for a package marker (it holds no code)."""
    name = path.relative_to(REPO / "rlhf_pipeline").with_suffix("").as_posix()
    return None if name.endswith("__init__") and name != "params/__init__" else name


def test_no_library_module_imports_one_above_it():
    """Pure maths and I/O at the bottom, training in the middle, audit and commands on top: an import
    of a higher floor (registry.py importing lineage/record.py was one) is refused, every module has
    its floor, and the library never imports the flow or the stages, which stand above it all."""
    floor = {name: level for level, names in LIBRARY_FLOORS.items() for name in names.split()}
    unplaced, upward = [], []
    for path in library_modules():
        name = _library_name(path)
        if name is None:
            continue
        if name not in floor:
            unplaced.append(name)
            continue
        for imported in imported_modules(path):
            assert imported.split(".")[0] not in {"flows", "stages"}, f"{name} imports {imported}"
            target = module_path(imported)
            other = _library_name(target) if target is not None and target != path else None
            if other is not None and floor.get(other, len(LIBRARY_FLOORS)) > floor[name]:
                upward.append(f"{name} (floor {floor[name]}) imports {other} (floor {floor.get(other)})")
    assert unplaced == [], f"modules with no floor in LIBRARY_FLOORS: {unplaced}"
    assert upward == [], upward
