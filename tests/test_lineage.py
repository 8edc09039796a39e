"""`rlhf lineage` on a throwaway git + DVC repo with a three-stage chain.

source.txt (dvc add) -> base_model -> models/base -> preferences -> data/preferences
                                  \\________________________________\\-> train_policy -> models/policy
The repo is built and reproduced once per module; tests that modify it work on a copy.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import yaml

from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.lineage.event import build_lineage
from rlhf_pipeline.lineage.render import lineage_cli

BIN = Path(sys.executable).parent
DVC = str(BIN / "dvc")
SOURCE_TEXT = "hello lineage\nsecond line\n"

SCRIPTS = {
    "scripts/base.py": """
        import hashlib, pathlib, yaml
        params = yaml.safe_load(open("params.yaml"))
        src = pathlib.Path("source.txt").read_bytes()
        out = pathlib.Path("models/base"); out.mkdir(parents=True, exist_ok=True)
        (out / "weights.txt").write_text(src.decode().upper() + params["base"]["name"] + "\\n")
        front = {"source": "source.txt", "source_sha256": hashlib.sha256(src).hexdigest(),
                 "library_name": "transformers"}
        (out / "README.md").write_text("---\\n" + yaml.safe_dump(front) + "---\\n\\n# Base model\\n")
    """,
    "scripts/prefs.py": """
        import json, pathlib, yaml
        params = yaml.safe_load(open("params.yaml"))
        n = params["prefs"]["n_rows"]
        weights = pathlib.Path("models/base/weights.txt").read_text()
        out = pathlib.Path("data/preferences"); out.mkdir(parents=True, exist_ok=True)
        with open(out / "rows.jsonl", "w") as f:
            for i in range(n):
                f.write(json.dumps({"query": i, "best": i % 2, "ctx": weights[:5]}) + "\\n")
        (out / "metrics.json").write_text(json.dumps({"rows": n}))
        pathlib.Path("data/validation").mkdir(parents=True, exist_ok=True)
        pathlib.Path("data/validation/summary.json").write_text(json.dumps({"success": True}))
        pathlib.Path("metrics").mkdir(exist_ok=True)
        pathlib.Path("metrics/preferences.json").write_text(
            json.dumps({"rows/train": n - 2, "rows/test": 2, "agreement": 0.75})  # per split, as the real stage
        )
    """,
    "scripts/policy.py": """
        import json, pathlib, yaml
        params = yaml.safe_load(open("params.yaml"))["policy"]
        rows = pathlib.Path("data/preferences/rows.jsonl").read_text().splitlines()
        base = pathlib.Path("models/base/weights.txt").read_text()
        out = pathlib.Path("models/policy"); out.mkdir(parents=True, exist_ok=True)
        (out / "weights.txt").write_text(base + str(len(rows) * params["lr"]))
        (out / "README.md").write_text("---\\nbase_model: models/base\\ndevice: cpu-test\\n---\\n\\n# Policy\\n")
        pathlib.Path("metrics").mkdir(exist_ok=True)
        pathlib.Path("metrics/policy.json").write_text(json.dumps({"reward": 1.5, "steps": params["steps"]}))
    """,
}

DVC_YAML = """
stages:
  base_model:
    cmd: python scripts/base.py
    deps: [scripts/base.py, source.txt]
    params: [base]
    outs: [models/base]
  preferences:
    cmd: python scripts/prefs.py
    deps: [scripts/prefs.py, models/base]
    params: [seed, prefs.n_rows]
    outs: [data/preferences, data/validation]
    metrics:
      - metrics/preferences.json:
          cache: false
  train_policy:
    cmd: python scripts/policy.py
    deps: [scripts/policy.py, models/base, data/preferences]
    params: [policy]
    outs: [models/policy]
    metrics:
      - metrics/policy.json:
          cache: false
"""

PARAMS = {"seed": 1, "base": {"name": "tiny"}, "prefs": {"n_rows": 6}, "policy": {"lr": 0.1, "steps": 3}}


def _env() -> dict[str, str]:
    env = dict(os.environ, DVC_NO_ANALYTICS="1", PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("RLHF_PROJECT_ROOT", None)
    return env


def _run(cwd: Path, *cmd: str) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _git(cwd: Path, *args: str) -> str:
    return _run(cwd, "git", "-c", "user.name=t", "-c", "user.email=t@t", *args)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lineage") / "proj"
    root.mkdir()
    for rel, body in SCRIPTS.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(body).lstrip())
    (root / "dvc.yaml").write_text(DVC_YAML.lstrip())
    (root / "params.yaml").write_text(yaml.safe_dump(PARAMS, sort_keys=False))
    (root / "source.txt").write_text(SOURCE_TEXT)
    _git(root, "init", "-q")
    _run(root, DVC, "init", "-q")
    _run(root, DVC, "add", "-q", "source.txt")
    _run(root, DVC, "repro", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "run pipeline")
    return root


@pytest.fixture()
def work(repo, tmp_path, monkeypatch) -> Path:
    """A private copy of the reproduced repo, as the working directory."""
    copy = tmp_path / "proj"
    shutil.copytree(repo, copy, symlinks=True)
    monkeypatch.chdir(copy)
    return copy


def _lineage_json(capsys, path: str) -> dict:
    capsys.readouterr()
    assert lineage_cli(path, as_json=True) == 0
    return json.loads(capsys.readouterr().out)


def _locked(repo: Path, stage: str, path: str) -> str:
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"][stage]
    return next(o["md5"] for o in lock["outs"] if o["path"] == path)


def _source_md5() -> str:
    return hashlib.md5(SOURCE_TEXT.encode()).hexdigest()


def test_text_report_names_stages_and_sources(repo, monkeypatch, capsys):
    monkeypatch.chdir(repo)
    assert lineage_cli("models/policy") == 0
    out = capsys.readouterr().out
    for stage in ("train_policy", "preferences", "base_model"):
        assert stage in out
    assert "python scripts/policy.py" in out
    assert "source.txt" in out and _source_md5() in out
    assert "tracked by source.txt.dvc" in out
    assert _locked(repo, "train_policy", "models/policy") in out
    head = _git(repo, "log", "-1", "--format=%H").strip()
    assert f"{head}  (clean)" in out
    assert "verdict      up to date" in out
    assert "policy.lr = 0.1" in out
    assert "6 rows (metrics/preferences.json); Great Expectations: passed" in out
    assert hashlib.sha256(SOURCE_TEXT.encode()).hexdigest() in out  # base model provenance
    assert '"reward": 1.5' in out
    assert "device cpu-test (models/policy/README.md)" in out
    print(out)  # visible with -s: the sample in the report


def test_a_fresh_clone_says_what_is_not_checked_out_and_dates_the_run_from_git(repo, tmp_path, monkeypatch, capsys):
    """A clone without DVC's outputs: the run is as recorded, its outputs are only absent, so the verdict
    says so in one paragraph (not STALE with a line per missing path), the run is dated by the commit that
    recorded it (not the clone's time), and the sources git holds, all as recorded, are one line."""
    clone = tmp_path / "clone"
    _git(tmp_path, "clone", "-q", str(repo), str(clone))
    monkeypatch.chdir(clone)
    assert lineage_cli("models/policy") == 0
    out = capsys.readouterr().out
    sha, seconds = _git(repo, "log", "-1", "--format=%h %ct", "--", "dvc.lock").split()
    when = dt.datetime.fromtimestamp(int(seconds), dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    assert f"run recorded by commit {sha} at {when}, dated from git" in out
    assert "verdict      NOT CHECKED OUT" in out and "STALE" not in out and "`dvc pull`" in out
    assert "(not here: data/preferences, data/validation, models/base, models/policy, source.txt)" in out
    assert "sources in git, each as recorded: scripts/policy.py" in out
    assert "\n  scripts/base.py\n" not in out  # folded, not an input line of its own
    event = _lineage_json(capsys, "models/policy")
    assert event["eventTime"] == when and event["run"]["facets"]["artifact"]["datedBy"] == f"commit {sha}"
    _validate_event(event)

    # one output checked out again, another source edited: the edit is listed, the absent ones fold
    (clone / "scripts/base.py").write_text((clone / "scripts/base.py").read_text() + "# edited\n")
    assert lineage_cli("models/policy") == 0
    out = capsys.readouterr().out
    assert "verdict      STALE" in out and "base_model: dep scripts/base.py modified" in out
    assert "- not checked out (data/preferences, data/validation, models/base, models/policy, source.txt)" in out


def test_json_is_an_openlineage_run_event(repo, monkeypatch, capsys):
    monkeypatch.chdir(repo)
    event = _lineage_json(capsys, "models/policy")
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    assert event["eventType"] == "COMPLETE"
    assert event["schemaURL"].endswith("#/$defs/RunEvent")
    assert event["job"]["namespace"] == "dvc://local"  # no remote, nothing configured
    assert event["job"]["name"] == "train_policy"
    assert event["job"]["facets"]["sourceCode"] == {
        **event["job"]["facets"]["sourceCode"],
        "language": "shell",
        "sourceCode": lock["train_policy"]["cmd"],
    }
    assert "sourceCodeLocation" not in event["job"]["facets"]  # a local checkout is no location for others
    assert str(repo) not in json.dumps(event) and repo.name not in event["job"]["namespace"]
    run = event["run"]
    uuid.UUID(run["runId"])
    assert _lineage_json(capsys, "models/policy")["run"]["runId"] == run["runId"]  # deterministic
    assert _lineage_json(capsys, "metrics/policy.json")["run"]["runId"] == run["runId"]  # same stage run
    assert _lineage_json(capsys, "models/base")["run"]["runId"] != run["runId"]
    facets = run["facets"]
    assert facets["parameters"]["values"] == {"policy.lr": 0.1, "policy.steps": 3}
    assert facets["upstreamParameters"]["stages"]["preferences"] == {"seed": 1, "prefs.n_rows": 6}
    assert facets["paramsDiff"]["changes"] == {}
    assert facets["git"]["dirty"] is False
    assert {k: v for k, v in facets["stale"].items() if not k.startswith("_")} == {
        "stale": False,
        "artifactModified": False,
        "reasons": [],
    }
    assert facets["metrics"]["files"] == {"metrics/policy.json": {"reward": 1.5, "steps": 3}}
    assert facets["upstreamMetrics"]["files"]["metrics/preferences.json"]["agreement"] == 0.75
    env = facets["environment"]
    assert set(env) >= {"torch", "transformers", "datasets", "dvc", "prefect", "device"}
    assert env["device"] == "cpu-test"
    names = [s["name"] for s in facets["dvcStages"]["stages"]]
    assert names[0] == "train_policy" and sorted(names[1:]) == ["base_model", "preferences"]

    inputs = {d["name"]: d["facets"]["dvc"] for d in event["inputs"]}
    base_card = next(d["facets"]["baseModel"] for d in event["inputs"] if d["name"] == "models/base")
    preference_data = next(d["facets"]["preferenceData"] for d in event["inputs"] if d["name"] == "data/preferences")
    assert set(inputs) == {
        "scripts/policy.py",
        "models/base",
        "data/preferences",
        "scripts/base.py",
        "source.txt",
        "scripts/prefs.py",
    }
    assert all(d["namespace"] == "dvc://local" for d in event["inputs"])
    source = inputs["source.txt"]
    assert source["hash"] == _source_md5() and source["producedBy"] is None and source["source"] is True
    assert source["trackedBy"] == "source.txt.dvc" and source["stale"] is False
    assert inputs["models/base"]["producedBy"] == "base_model"
    assert sorted(inputs["models/base"]["consumedBy"]) == ["preferences", "train_policy"]
    assert inputs["models/base"]["hash"] == _locked(repo, "base_model", "models/base")
    assert base_card["source_sha256"] == hashlib.sha256(SOURCE_TEXT.encode()).hexdigest()
    assert inputs["data/preferences"]["producedBy"] == "preferences"
    assert preference_data["rows"] == 6 and preference_data["validation"]["success"] is True
    outputs = {d["name"]: d["facets"]["dvc"] for d in event["outputs"]}
    assert outputs["models/policy"]["hash"] == _locked(repo, "train_policy", "models/policy")
    assert outputs["metrics/policy.json"]["metric"] is True


def test_files_inside_outputs_metrics_and_dvc_added_sources(repo, monkeypatch, capsys):
    monkeypatch.chdir(repo / "models")  # paths resolve from the current directory
    event = _lineage_json(capsys, "policy/README.md")
    assert event["job"]["name"] == "train_policy"
    artifact = event["run"]["facets"]["artifact"]
    assert artifact["output"] == "models/policy" and artifact["status"] == "ok"
    assert artifact["lockedHash"] == hashlib.md5((repo / "models/policy/README.md").read_bytes()).hexdigest()

    monkeypatch.chdir(repo)
    event = _lineage_json(capsys, "data/preferences")
    assert event["job"]["name"] == "preferences"
    assert {d["name"] for d in event["inputs"]} >= {"models/base", "source.txt"}
    assert event["run"]["facets"]["metrics"]["files"]["metrics/preferences.json"]["rows/train"] == 4

    event = _lineage_json(capsys, "source.txt")
    assert event["job"]["name"] == "source.txt.dvc"
    assert event["inputs"] == [] and event["outputs"][0]["facets"]["dvc"]["hash"] == _source_md5()
    assert _lineage_json(capsys, "source.txt.dvc")["job"]["name"] == "source.txt.dvc"


def test_params_diff_after_editing_params(work, capsys):
    params = yaml.safe_load(Path("params.yaml").read_text())
    params["policy"]["lr"] = 0.5
    params["prefs"]["n_rows"] = 9
    Path("params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))

    event = _lineage_json(capsys, "models/policy")
    diff = event["run"]["facets"]["paramsDiff"]["changes"]
    assert diff == {
        "policy.lr": {"old": 0.1, "new": 0.5, "stages": ["train_policy"]},
        "prefs.n_rows": {"old": 6, "new": 9, "stages": ["preferences"]},
    }
    git = event["run"]["facets"]["git"]
    assert git["dirty"] is True and "params.yaml" in git["changedSinceCommit"]
    assert event["run"]["facets"]["stale"]["stale"] is True
    assert event["run"]["facets"]["stale"]["artifactModified"] is False

    assert lineage_cli("models/policy") == 0
    out = capsys.readouterr().out
    assert "policy.lr: 0.1 -> 0.5  (stage train_policy)" in out
    assert "prefs.n_rows: 6 -> 9  (stage preferences)" in out
    assert "DIRTY" in out


@pytest.mark.e2e
def test_a_stage_with_two_changed_params_files_lists_each_value_once(work, capsys):
    """Each changed value is one reason, under its own file: not every file's changes for every file."""
    Path("extra.yaml").write_text("k: 1\n")
    stage = ["-n", "two_files", "-p", "policy.lr", "-p", "extra.yaml:k", "-o", "two.txt", "echo x > two.txt"]
    _run(work, DVC, "stage", "add", "-q", *stage)
    _run(work, DVC, "repro", "-q", "two_files")
    params = yaml.safe_load(Path("params.yaml").read_text())
    params["policy"]["lr"] = 0.5
    Path("params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    Path("extra.yaml").write_text("k: 2\n")

    reasons = _lineage_json(capsys, "two.txt")["run"]["facets"]["dvcStages"]["stages"][0]["reasons"]
    assert sorted(reasons) == ["param extra.yaml:k changed: 1 -> 2", "param policy.lr changed: 0.1 -> 0.5"]


def test_corrupted_input_and_output_are_reported(work, capsys):
    (work / "models/base/weights.txt").write_text("corrupted\n")
    event = _lineage_json(capsys, "models/policy")
    inputs = {d["name"]: d["facets"]["dvc"] for d in event["inputs"]}
    assert inputs["models/base"]["stale"] is True
    assert inputs["models/base"]["status"] == "modified"
    assert inputs["models/base"]["files"]["modified"] == ["models/base/weights.txt"]
    assert inputs["data/preferences"]["stale"] is False
    stale = event["run"]["facets"]["stale"]
    assert stale["stale"] is True and stale["artifactModified"] is False
    assert any("models/base modified" in r and r.startswith("train_policy:") for r in stale["reasons"])
    assert lineage_cli("models/policy") == 0
    out = capsys.readouterr().out
    assert "MODIFIED (modified models/base/weights.txt)" in out
    assert "STALE" in out

    # DVC agrees that the corrupted directory no longer matches the lock
    status = json.loads(_run(work, DVC, "status", "--json"))
    assert "base_model" in status and "train_policy" in status

    # a modified source and a modified file of the artifact itself
    (work / "source.txt").write_text("tampered\n")
    (work / "models/policy/README.md").write_text("no front matter\n")
    event = _lineage_json(capsys, "models/policy")
    inputs = {d["name"]: d["facets"]["dvc"] for d in event["inputs"]}
    assert inputs["source.txt"]["stale"] is True
    assert inputs["source.txt"]["hash"] == _source_md5()
    stale = event["run"]["facets"]["stale"]
    assert stale["artifactModified"] is True
    assert event["run"]["facets"]["artifact"]["files"]["modified"] == ["models/policy/README.md"]
    assert _lineage_json(capsys, "models/policy/README.md")["run"]["facets"]["artifact"]["status"] == "modified"
    assert _lineage_json(capsys, "models/policy/weights.txt")["run"]["facets"]["artifact"]["status"] == "ok"


def test_user_errors_name_the_path(repo, tmp_path, monkeypatch):
    monkeypatch.chdir(repo)
    with pytest.raises(PipelineError, match="nope/missing.bin") as info:
        build_lineage("nope/missing.bin")
    assert "not produced by any DVC stage" in str(info.value)
    with pytest.raises(PipelineError, match="scripts/base.py") as info:
        build_lineage("scripts/base.py")
    assert "base_model" in str(info.value)  # a plain source: says which stage reads it
    with pytest.raises(PipelineError, match="models/base"):
        build_lineage("models")  # a folder holding outputs, not an output

    outside = tmp_path / "plain"
    outside.mkdir()
    (outside / "x.txt").write_text("x")
    with pytest.raises(PipelineError, match="x.txt.*not inside a DVC repository"):
        build_lineage(str(outside / "x.txt"))
    (outside / ".dvc").mkdir()
    with pytest.raises(PipelineError, match="x.txt.*no dvc.lock"):
        build_lineage(str(outside / "x.txt"))


def test_real_cli(repo):
    cmd = [sys.executable, "-m", "rlhf_pipeline.cli", "lineage"]
    ok = subprocess.run(
        [*cmd, "models/policy", "--json"], cwd=repo, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["job"]["name"] == "train_policy"
    bad = subprocess.run(
        [*cmd, "does/not/exist.txt"], cwd=repo, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2  # a path no stage produces: the user's to correct, not retried
    assert "does/not/exist.txt" in bad.stderr and "Traceback" not in bad.stderr


def test_an_exponent_float_in_params_equals_the_locked_float(work, capsys):
    """dvc.lock (YAML 1.2) writes 1e-05 where params.yaml may say 1.0e-5: the same number, not a change."""
    text = Path("params.yaml").read_text()
    Path("params.yaml").write_text(text.replace("lr: 0.1", "lr: 1.0e-1"))
    assert "1.0e-1" in Path("params.yaml").read_text()
    assert _lineage_json(capsys, "models/policy")["run"]["facets"]["paramsDiff"]["changes"] == {}


@pytest.mark.parametrize(
    ("remote", "uri", "namespace"),
    [
        ("https://ci:s3cret@github.com/org/rlhf.git", "https://github.com/org/rlhf.git", "dvc://github.com/org/rlhf"),
        ("git@github.com:org/rlhf.git", "ssh://git@github.com/org/rlhf.git", "dvc://github.com/org/rlhf"),
        (
            "ssh://git@host.example:2222/srv/rlhf/",
            "ssh://git@host.example:2222/srv/rlhf/",
            "dvc://host.example/srv/rlhf",
        ),
        ("/srv/git/rlhf.git", None, None),
        ("file:///srv/git/rlhf.git", None, None),
        ("../rlhf", None, None),
    ],
)
def test_a_remote_is_shared_without_credentials_and_a_local_path_never(remote, uri, namespace):
    from rlhf_pipeline.lineage.record import remote_namespace, shareable_remote

    assert shareable_remote(remote) == uri
    if uri:
        assert remote_namespace(uri) == namespace


def test_lineage_travels_with_the_remote_not_the_folder(repo, tmp_path, monkeypatch, capsys):
    """Two clones in different folders give the same namespace, job and run ids; the event time is the
    producing run's, not the time of the call; a configured namespace wins."""
    events = []
    for folder in ("first", "second/deeper"):
        copy = tmp_path / folder
        shutil.copytree(repo, copy, symlinks=True)
        _git(copy, "remote", "add", "origin", "https://ci:s3cret@github.com/org/rlhf.git")
        monkeypatch.chdir(copy)
        events.append(_lineage_json(capsys, "models/policy"))
        assert str(copy) not in json.dumps(events[-1]) and "s3cret" not in json.dumps(events[-1])
        _validate_event(events[-1])
    first, second = events
    assert first["job"]["namespace"] == second["job"]["namespace"] == "dvc://github.com/org/rlhf"
    assert first["run"]["runId"] == second["run"]["runId"]
    location = first["job"]["facets"]["sourceCodeLocation"]
    assert location["url"] == "https://github.com/org/rlhf.git" and location["path"] == "dvc.lock"
    assert location["version"] == _git(repo, "log", "-1", "--format=%H", "--", "dvc.lock").strip()

    newest = max(f.stat().st_mtime for f in (repo / "models/policy").rglob("*") if f.is_file())
    produced = dt.datetime.fromisoformat(first["eventTime"].replace("Z", "+00:00")).timestamp()
    assert abs(produced - newest) < 0.01  # copytree keeps mtimes: the run's time, in both clones
    assert first["eventTime"] == second["eventTime"]

    monkeypatch.setenv("OPENLINEAGE_NAMESPACE", "team-rlhf")
    assert _lineage_json(capsys, "models/policy")["job"]["namespace"] == "team-rlhf"
    capsys.readouterr()
    assert lineage_cli("models/policy", namespace="cli-name") == 0
    assert "namespace    cli-name" in capsys.readouterr().out


OPENLINEAGE_SPEC = Path(__file__).parent / "openlineage"  # the published spec, vendored with its licence


def _validate_event(event: dict) -> None:
    """The event against the published OpenLineage spec (2-0-2), formats (uri, uuid, date-time) checked,
    then each facet against the definition its own _schemaURL names: the spec's standard facet files
    or the project's custom facets in the package's schema.json (each extending the spec's RunFacet or
    DatasetFacet)."""
    from jsonschema import Draft202012Validator
    from referencing import Registry, Resource

    import rlhf_pipeline.lineage as lineage_package

    schemas = [json.loads(p.read_text()) for p in sorted(OPENLINEAGE_SPEC.glob("*.json"))]
    schemas.append(json.loads((Path(lineage_package.__file__).parent / "schema.json").read_text()))
    registry = Registry().with_resources((s["$id"], Resource.from_contents(s)) for s in schemas)
    checker = Draft202012Validator.FORMAT_CHECKER
    assert {"uri", "uuid", "date-time"} <= set(checker.checkers), "jsonschema's format extras are not installed"

    def validate(instance: dict, ref: str) -> None:
        Draft202012Validator({"$ref": ref}, registry=registry, format_checker=checker).validate(instance)

    validate(event, "https://openlineage.io/spec/2-0-2/OpenLineage.json")
    facets = [
        *event["job"]["facets"].values(),
        *event["run"]["facets"].values(),
        *(f for d in event["inputs"] + event["outputs"] for f in d["facets"].values()),
    ]
    known = {s["$id"] for s in schemas}
    for facet in facets:
        assert facet["_schemaURL"].partition("#")[0] in known, f"no schema for {facet['_schemaURL']}"
        validate(facet, facet["_schemaURL"])


def test_json_event_validates_against_the_openlineage_schema(work, capsys):
    for path in ("models/policy", "models/policy/README.md", "source.txt", "data/preferences"):
        _validate_event(_lineage_json(capsys, path))
    (work / "models/base/weights.txt").write_text("corrupted\n")  # a stale event: files and reasons filled in
    event = _lineage_json(capsys, "models/policy")
    assert event["run"]["facets"]["stale"]["stale"] is True
    _validate_event(event)
    event["run"]["facets"]["git"].pop("_producer")
    with pytest.raises(Exception, match="_producer"):
        _validate_event(event)


def test_the_event_names_this_package_as_producer_and_its_shipped_schema(work, capsys):
    """No address of a repository that is not this project's: the producer is the package at its version,
    each custom facet's schema is the schema.json the package ships (found by its $id), and with no git
    remote nothing in the event names a web host."""
    import rlhf_pipeline
    import rlhf_pipeline.lineage as lineage_package

    event = _lineage_json(capsys, "models/policy")
    producer = f"pkg:generic/rlhf-pipeline@{rlhf_pipeline.__version__}"
    assert event["producer"] == producer
    shipped = json.loads((Path(lineage_package.__file__).parent / "schema.json").read_text())
    facets = [
        *event["run"]["facets"].values(),
        *(f for d in event["inputs"] + event["outputs"] for f in d["facets"].values()),
    ]
    assert {f["_producer"] for f in facets} == {producer}
    custom = [f["_schemaURL"] for f in facets if "openlineage.io" not in f["_schemaURL"]]
    assert custom and {url.partition("#")[0] for url in custom} == {shipped["$id"]}
    assert all(url.partition("#")[2].removeprefix("/$defs/") in shipped["$defs"] for url in custom)
    assert "github.com" not in json.dumps(event)
