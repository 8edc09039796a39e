"""dvc.yaml declares exactly what each stage reads: its code (derived here from the imports) and
its params (enforced at run time by the stage runner's restricted view)."""

from __future__ import annotations

import pytest
import yaml
from conftest import run_stage_script
from stage_imports import REPO, import_chain, pipeline_stages, project_files, stage_script

from rlhf_pipeline.params import Params
from rlhf_pipeline.runner import run_stage
from rlhf_pipeline.stage_params import DeclaredParams, UndeclaredParamError, declared_param_keys

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
    scripts = {stage_script(stage) for stage in pipeline_stages()}
    assert scripts == {f"stages/{p.name}" for p in (REPO / "stages").glob("*.py")}


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
    run_stage("probe", lambda params: seen.append((params.seed, params.ppo.lr)), argv=[])
    assert seen == [(5, 1.0e-5)]
    with pytest.raises(SystemExit) as exit_:
        run_stage("probe", lambda params: params.ppo.cliprange, argv=[])
    assert exit_.value.code == 2
    assert "stage probe read params.yaml key 'ppo.cliprange'" in capsys.readouterr().err


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


def test_every_declared_key_is_a_parameter():
    """Every declared key names a real parameter (a typo in dvc.yaml would track nothing)."""
    fields = set()

    def walk(model, prefix=""):
        for name in type(model).model_fields:
            path = f"{prefix}{name}"
            fields.add(path)
            value = getattr(model, name)
            if hasattr(type(value), "model_fields"):
                walk(value, path + ".")

    walk(Params())
    for stage in pipeline_stages():
        keys = declared_param_keys(stage.name, REPO)
        assert keys is not None, f"stage {stage.name} declares the whole params file"
        assert keys <= fields, f"stage {stage.name}: unknown keys {sorted(keys - fields)}"


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
        run_stage("probe", lambda params: ran.append(params.seed), argv=[])
    assert exit_.value.code == 2 and not ran
    assert "ppo.lr: missing; dvc.yaml tracks it for stage probe" in capsys.readouterr().err


def test_the_code_hash_follows_the_declared_code(monkeypatch):
    """train_policy's checkpoint fingerprint includes this hash: editing any module the stage
    declares (here ppo.py, simulated) changes it, so an old checkpoint is not resumed."""
    import rlhf_pipeline.io as io
    from rlhf_pipeline.stage_params import declared_code_hash

    before, base_before = declared_code_hash("train_policy", REPO), declared_code_hash("base_model", REPO)
    assert before == declared_code_hash("train_policy", REPO)
    real = io.sha256_file
    monkeypatch.setattr(
        io, "sha256_file", lambda path: "edited" if str(path).endswith("rlhf_pipeline/ppo.py") else real(path)
    )
    assert declared_code_hash("train_policy", REPO) != before
    assert declared_code_hash("base_model", REPO) == base_before  # base_model does not import ppo.py
