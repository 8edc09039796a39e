"""The human loop's doors against an adversarial user (issue 106): a forged or repeated verdict is
never counted, a round edited by hand is refused, two writers at once lose nothing, no command writes
over a file the project owns, model folders stay inside the project, registry names and dangling tags
are refused by name, and people's identities reach no tracked file. Secrets: tests/test_redaction.py
and tests/test_hostile_labels.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_labelling import answer
from test_labelling import task as labelling_task

from rlhf_pipeline.errors import DataContractError, SettingsError
from rlhf_pipeline.label_studio.export import rows_from_export
from rlhf_pipeline.project_files import owner_of, project_relative
from rlhf_pipeline.project_key import KEY_FILE, project_key, pseudonym, seal
from rlhf_pipeline.side_by_side import (
    CHALLENGER,
    INCUMBENT,
    VERDICT_FIELDS,
    Round,
    load_round,
    read_verdicts,
    round_path,
    tally,
    task_id,
)

RLHF = [sys.executable, "-m", "rlhf_pipeline.cli"]
SHAS = ("c" * 64, "1" * 64)
HYPOTHESIS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def rlhf(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*RLHF, *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def refused(result: subprocess.CompletedProcess, code: int, *words: str) -> None:
    assert result.returncode == code, f"exit {result.returncode}: {result.stderr[-1500:]}"
    assert "Traceback" not in result.stderr and result.stderr.count("\n") <= 2, result.stderr
    for word in words:
        assert word in result.stderr, f"{word!r} not in {result.stderr}"


# --------------------------------------------------------------------------------------------
# a round and its verdicts
# --------------------------------------------------------------------------------------------
def a_round(queries: int = 4) -> Round:
    """A round of ``queries`` tasks as `rlhf label compare` records it (no model needed to make one)."""
    record = Round("policy@v2.0.0", SHAS[0], "policy@v1.0.0", SHAS[1], 3, "test", "2026-12-07T00:00:00+00:00", {}, {})
    for index in range(queries):
        tid = task_id(record.name, list(SHAS), "test", index, 3)
        record.order[tid], record.queries[tid] = (CHALLENGER, INCUMBENT)[index % 2], index
    return record


def export_of(record: Round, people: dict[str, str]) -> list[dict]:
    """Label Studio's export of ``record``'s tasks: each person (id -> a, b or tie) answers every task."""
    versions = sorted([record.challenger, record.incumbent])
    shas = {record.challenger: record.challenger_sha256, record.incumbent: record.incumbent_sha256}
    tasks = []
    for number, (tid, index) in enumerate(record.queries.items()):
        data = {
            "task_id": tid, "comparison": record.name, "query": f"Query {index}.", "response_a": f"A {index}",
            "response_b": f"B {index}", "versions": versions, "sha256": [shas[v] for v in versions],
            "split": record.split, "query_index": index, "seed": record.seed,
        }  # fmt: skip
        annotations = [
            {"id": 100 * number + k, "completed_by": who, "result": [
                {"from_name": "best", "to_name": "query", "type": "choices", "value": {"choices": [choice]}}
            ]}
            for k, (who, choice) in enumerate(people.items())
        ]  # fmt: skip
        tasks.append({"id": number + 1, "data": data, "annotations": annotations})
    return tasks


def saved(record: Round, root: Path, people: dict[str, str] | None = None) -> Path:
    """``record`` saved in ``root`` with the verdicts of ``people``' answers imported into it."""
    record.save(root)
    if people:
        (answered,), _ = read_verdicts(export_of(record, people), "export.json", root)
        answered.save(root)
    return round_path(root, record.challenger, record.incumbent)


def test_a_round_as_written_is_counted_and_one_edited_by_hand_is_refused(tmp_path):
    path = saved(a_round(), tmp_path, {"1": "a", "2": "tie"})
    counted = tally(load_round(path).verdicts, 0.5, 0.95)
    assert counted.n == 8 and counted.ties == 4 and len(counted.annotators) == 2
    assert all(set(v) == VERDICT_FIELDS for v in load_round(path).verdicts)

    payload = json.loads(path.read_text())
    one = payload["verdicts"][0]
    for forged in (
        [*payload["verdicts"], *[dict(one)] * 6],  # six copies of one person's answer
        [*payload["verdicts"], dict(one, task_id="0" * 16, annotator="x")],  # a task the round never made
        [dict(v, winner=CHALLENGER) for v in payload["verdicts"]],  # answers changed
    ):
        path.write_text(json.dumps({**payload, "verdicts": forged}))
        with pytest.raises(DataContractError, match="its seal does not agree"):
            load_round(path)


@pytest.mark.parametrize(
    "forge, words",
    [
        (lambda r: r.verdicts.extend([dict(r.verdicts[0])] * 6), "is a second answer by annotator"),
        (lambda r: r.verdicts.append(dict(r.verdicts[0], task_id="0" * 16)), "which the round did not make"),
        (lambda r: r.verdicts.append(dict(r.verdicts[0], query_index=99)), "another query index"),
        (lambda r: r.verdicts.append(dict(r.verdicts[0], winner="me")), "names no winner"),
        (lambda r: r.verdicts.append("challenger"), "is not an object of"),
        (lambda r: r.verdicts.append({**r.verdicts[0], "weight": 10}), "is not an object of"),
        (lambda r: r.queries.update({"f" * 16: 9}), "is not the task of its query index"),
        (lambda r: setattr(r, "challenger_sha256", "x"), "challenger_sha256 is not 64 hexadecimal digits"),
    ],
)
def test_a_forged_round_is_refused_naming_the_verdict_even_with_the_key(tmp_path, forge, words):
    """One who holds the project key (or a bug) can seal anything: the verdicts are checked apart from the seal."""
    record = load_round(saved(a_round(), tmp_path, {"1": "a", "2": "b"}))
    forge(record)
    path = round_path(tmp_path, record.challenger, record.incumbent)
    payload = {k: v for k, v in record.__dict__.items() if k != "seal"}
    path.write_text(json.dumps({**payload, "seal": seal(payload, project_key(tmp_path))}))
    with pytest.raises(DataContractError, match=words) as caught:
        load_round(path)
    assert str(path) in str(caught.value)


def mutations(value) -> st.SearchStrategy:
    """A JSON value with one edit at a random place: a key or item removed, replaced, duplicated or added."""
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.text(max_size=20))
    anything = st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
        max_leaves=6,
    )

    @st.composite
    def edit(draw, node):
        if isinstance(node, dict) and node and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(node)))
            return {**node, key: draw(edit(node[key]))}
        if isinstance(node, list) and node and draw(st.booleans()):
            at = draw(st.integers(0, len(node) - 1))
            return [*node[:at], draw(edit(node[at])), *node[at + 1 :]]
        how = draw(st.sampled_from(["replace", "remove", "duplicate", "add"]))
        if how == "replace" or not isinstance(node, (dict, list)) or not node:
            return draw(anything)
        if isinstance(node, list):
            at = draw(st.integers(0, len(node) - 1))
            return {"remove": node[:at] + node[at + 1 :], "duplicate": [*node, node[at]]}.get(
                how, [*node, draw(anything)]
            )
        key = draw(st.sampled_from(sorted(node)))
        if how == "remove":
            return {k: v for k, v in node.items() if k != key}
        return {**node, draw(st.text(max_size=8)): node[key] if how == "duplicate" else draw(anything)}

    return edit(value)


@pytest.fixture
def answered_round(tmp_path_factory):
    root = tmp_path_factory.mktemp("round")
    path = saved(a_round(), root, {"1": "a", "2": "b", "3": "tie"})
    return root, path, json.loads(path.read_text())


@HYPOTHESIS
@given(data=st.data())
def test_any_edit_of_a_round_file_is_refused_or_counted_as_the_rule_says(answered_round, data):
    root, path, payload = answered_round
    edited = data.draw(mutations(payload))
    resealed = data.draw(st.booleans())  # as one who holds the key would
    if resealed and isinstance(edited, dict):
        content = {k: v for k, v in edited.items() if k != "seal"}
        edited = {**content, "seal": seal(content, project_key(root))}
    path.write_text(json.dumps(edited))
    try:
        record = load_round(path, root)
    except DataContractError:
        return
    finally:
        path.write_text(json.dumps(payload))
    if not resealed:
        assert record.__dict__ == payload  # only an edit that changed nothing passes unsealed
    counted = tally(record.verdicts, 0.5, 0.95)
    answers = {(v["task_id"], v["annotator"]) for v in record.verdicts}
    assert counted.n == len(record.verdicts) == len(answers)  # one answer per person per task
    assert all(
        v["task_id"] in record.order and v["query_index"] == record.queries[v["task_id"]] for v in record.verdicts
    )


@HYPOTHESIS
@given(data=st.data())
def test_any_edit_of_a_side_by_side_export_is_refused_or_read_into_a_valid_round(answered_round, data):
    root, path, payload = answered_round
    record = Round(**{**payload, "verdicts": [], "seal": ""})
    record.save(root)
    export = data.draw(mutations(export_of(record, {"7": "a", "8": "tie"})))
    try:
        rounds, report = read_verdicts(export if isinstance(export, list) else [export], "export.json", root)
        for answered in rounds:
            answered.save(root)
            again = load_round(path, root)  # what an import writes, the gate accepts
            assert len(again.verdicts) == len({(v["task_id"], v["annotator"]) for v in again.verdicts})
    except DataContractError:
        pass
    finally:
        path.write_text(json.dumps(payload))


@HYPOTHESIS
@given(data=st.data())
def test_any_edit_of_a_best_of_n_export_is_refused_or_read_into_valid_rows(data):
    export = [labelling_task(i, [answer(10 * i, 1, "0"), answer(10 * i + 1, 2, "1")], n=2) for i in range(3)]
    edited = data.draw(mutations(export))
    try:
        report = rows_from_export(edited if isinstance(edited, list) else [edited], "export.json", b"key")
    except DataContractError:
        return
    assert len({(r["task_id"], r["annotator"]) for r in report.rows}) == len(report.rows)
    assert all(r["best"] in (0, 1) and r["annotator"].startswith("annotator-") for r in report.rows)


def test_the_verdicts_command_refuses_a_round_edited_by_hand_and_imports_into_the_others(tmp_path):
    good, damaged = a_round(), Round(**{**a_round().__dict__, "challenger": "policy@v3.0.0", "order": {}})
    damaged.queries = {}
    for index in range(2):
        tid = task_id(damaged.name, list(SHAS), "test", index, 3)
        damaged.order[tid], damaged.queries[tid] = CHALLENGER, index
    saved(good, tmp_path), saved(damaged, tmp_path)
    edited = round_path(tmp_path, damaged.challenger, damaged.incumbent)
    edited.write_text(edited.read_text().replace("2026-12-07", "2026-12-08"))  # its date moved by hand
    (tmp_path / "good.json").write_text(json.dumps(export_of(good, {"1": "a"})))
    (tmp_path / "damaged.json").write_text(json.dumps(export_of(damaged, {"1": "a"})))
    refused(rlhf("label", "verdicts", "damaged.json", cwd=tmp_path), 3, "its seal does not agree", edited.name)
    imported = rlhf("label", "verdicts", "good.json", cwd=tmp_path)
    assert imported.returncode == 0 and json.loads(imported.stdout)["added"] == {good.name: 4}, imported.stderr


# --------------------------------------------------------------------------------------------
# two writers at once
# --------------------------------------------------------------------------------------------
def at_once(commands: list[list[str]], cwd: Path) -> list[subprocess.CompletedProcess]:
    started = [
        subprocess.Popen(c, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands
    ]
    return [subprocess.CompletedProcess(p.args, p.wait(300), *p.communicate()) for p in started]


def test_two_imports_appending_to_one_labels_file_at_once_keep_every_row(tmp_path):
    for name, first in (("a", 0), ("b", 50)):
        export = [
            labelling_task(i, [answer(i, 1, "0"), answer(i + 1000, 2, "1")], n=2) for i in range(first, first + 30)
        ]
        (tmp_path / f"{name}.json").write_text(json.dumps(export))
    project_key(tmp_path)  # made once, before the two race to make it
    for attempt in range(3):
        (tmp_path / "labels.jsonl").unlink(missing_ok=True)
        done = at_once([[*RLHF, "label", "import", f"{n}.json", "labels.jsonl", "--append"] for n in "ab"], tmp_path)
        assert all(d.returncode == 0 for d in done), [d.stderr for d in done]
        rows = [json.loads(line) for line in (tmp_path / "labels.jsonl").read_text().splitlines()]
        assert len(rows) == 120 and len({(r["task_id"], r["annotator"]) for r in rows}) == 120, attempt


def test_two_verdict_imports_into_one_round_at_once_keep_every_verdict(tmp_path):
    record = a_round(6)
    saved(record, tmp_path)
    for name, person in (("a", "1"), ("b", "2")):
        (tmp_path / f"{name}.json").write_text(json.dumps(export_of(record, {person: "a"})))
    done = at_once([[*RLHF, "label", "verdicts", f"{n}.json"] for n in "ab"], tmp_path)
    assert all(d.returncode == 0 for d in done), [d.stderr for d in done]
    assert len(load_round(round_path(tmp_path, record.challenger, record.incumbent)).verdicts) == 12


# --------------------------------------------------------------------------------------------
# the project's own files, and paths that leave the project
# --------------------------------------------------------------------------------------------
LABELS = "data/labels/human.jsonl"


@pytest.fixture
def project(tmp_path):
    """A git and DVC project: a stage with outputs, a dvc-added labels file, params naming it."""
    root = tmp_path / "project"
    (root / "data" / "labels").mkdir(parents=True)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=root, check=True)
    stages = {"stages": {"preferences": {"cmd": "true", "outs": ["data/preferences"], "metrics": ["metrics/p.json"]}}}
    (root / "dvc.yaml").write_text(yaml.safe_dump(stages))
    (root / "params.yaml").write_text(yaml.safe_dump({"data": {"preferences": {"source": LABELS}}}))
    (root / f"{LABELS}.dvc").write_text(yaml.safe_dump({"outs": [{"path": "human.jsonl", "md5": "0" * 32}]}))
    (root / "README.md").write_text("notes\n")
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    export = [labelling_task(i, [answer(i, 1, str(i % 2))], n=2) for i in range(4)]
    (root / "export.json").write_text(json.dumps(export))
    return root


@pytest.mark.parametrize(
    "output, owner",
    [
        ("params.yaml", "one of the project's records"),
        ("dvc.lock", "one of the project's records"),
        (".dvc/config", "in .dvc/"),
        ("side_by_side/x.json", "in side_by_side/"),
        ("data/preferences/train.jsonl", "a stage's output (dvc.yaml): data/preferences"),
        ("metrics/p.json", "a stage's output (dvc.yaml): metrics/p.json"),
        (f"{LABELS}.dvc", "a .dvc file"),
        (LABELS, "data.preferences.source"),
        ("README.md", "a file git tracks"),
    ],
)
def test_no_command_writes_over_a_file_the_project_owns(project, output, owner):
    target = project / output
    before = target.read_bytes() if target.is_file() else None
    for command in (
        ("label", "import", "export.json", output),
        ("label", "export", output, "--model", "models/base"),
        ("label", "compare", "policy@v1", "models/base", output),
        ("export-preferences", output),
    ):
        result = rlhf(*command, cwd=project)
        # export-preferences reads data/preferences: that refusal comes first there
        inside_its_input = command[0] == "export-preferences" and output.startswith("data/preferences/")
        refused(result, 2, "nothing was written", *(() if inside_its_input else (owner,)))
        assert (target.read_bytes() if target.is_file() else None) == before, command


def test_the_labels_file_is_written_only_by_an_append(project):
    appended = rlhf("label", "import", "export.json", LABELS, "--append", cwd=project)
    assert appended.returncode == 0, appended.stderr
    assert len((project / LABELS).read_text().splitlines()) == 4
    assert owner_of(project / "data" / "new.jsonl", project, LABELS) is None
    assert owner_of(Path("/elsewhere/x"), project, LABELS) is None


@pytest.mark.parametrize(
    "judge, words",
    [
        ("data/models/../../../x", "must be a path inside the project"),
        ("data/models/./judge", "must be a path inside the project"),
        ("data/models/outside", "resolves outside the project"),  # a link leading out
    ],
)
def test_a_judge_folder_outside_the_project_is_refused_by_check_params(project, tmp_path, judge, words):
    (tmp_path / "elsewhere").mkdir()
    (project / "data" / "models").mkdir(parents=True)
    (project / "data" / "models" / "outside").symlink_to(tmp_path / "elsewhere")
    params = yaml.safe_load((project / "params.yaml").read_text())
    (project / "params.yaml").write_text(yaml.safe_dump({**params, "promotion": {"judge": judge}}))
    refused(rlhf("check-params", cwd=project), 2, words)


def test_a_model_folder_outside_the_project_is_refused_and_one_inside_is_named_by_its_path_there(project, tmp_path):
    outside = tmp_path / "outside-model"
    outside.mkdir()
    for command in (
        ("label", "export", "tasks.json", "--model", str(outside)),
        ("label", "compare", str(outside), "models/base", "tasks.json"),
        ("label", "export", "tasks.json", "--model", "../outside-model"),
    ):
        refused(rlhf(*command, cwd=project), 2, "resolves outside the project")
        assert not (project / "tasks.json").exists()
    named = rlhf("label", "export", "tasks.json", "--model", "models/base", "--model-name", str(outside), cwd=project)
    refused(named, 2, "a name (policy@v2, base), not a path outside the project")
    (project / "models" / "policy").mkdir(parents=True)
    assert project_relative(project / "models" / "policy", project, "m") == "models/policy"
    assert project_relative("models/../models/policy", project, "m") == "models/policy"
    with pytest.raises(SettingsError, match="resolves outside the project"):
        project_relative("models/../../outside-model", project, "m")


# --------------------------------------------------------------------------------------------
# registry names and tags
# --------------------------------------------------------------------------------------------
def test_stage_names_and_a_dangling_stage_tag_are_refused_by_name(project):
    artifacts = {"artifacts": {"policy": {"path": "models/policy", "type": "model"}}}
    (project / "dvc.yaml").write_text(
        yaml.safe_dump({**yaml.safe_load((project / "dvc.yaml").read_text()), **artifacts})
    )
    lock = {"schema": "2.0", "stages": {"train": {"cmd": "true", "outs": [{"path": "models/policy", "md5": "a.dir"}]}}}
    (project / "dvc.lock").write_text(yaml.safe_dump(lock))
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    subprocess.run(["git", "add", "-A"], cwd=project, check=True)
    subprocess.run(["git", "commit", "-qm", "run"], cwd=project, check=True, env=env)
    from gto import api

    api.register(str(project), "policy", "HEAD", version="v1.0.0")
    for stage in ("../x", "prod;rm", "p", "-prod", "a/b"):
        refused(
            rlhf("models", "assign", "policy", "v1", f"--stage={stage}", cwd=project, env=env), 2, "not a stage's name"
        )
    assigned = rlhf("models", "assign", "policy", "v1", cwd=project, env=env)
    assert assigned.returncode == 0, assigned.stderr
    subprocess.run(["git", "tag", "-d", "policy@v1.0.0"], cwd=project, check=True, capture_output=True)

    listed = rlhf("models", cwd=project, env=env)
    assert listed.returncode == 0 and "dangling: policy#prod#1 points at commit" in listed.stdout, listed.stderr
    refused(rlhf("models", "get", "policy", "--from-stage", "prod", "-o", "out", cwd=project, env=env), 2, "dangling")
    refused(rlhf("models", "get", "policy", "--from-stage", "../x", "-o", "out", cwd=project, env=env), 2, "names no")
    refused(rlhf("models", "assign", "policy", "v1", cwd=project, env=env), 2, "has no version v1.0.0")
    assert not (project / "out").exists()


# --------------------------------------------------------------------------------------------
# people's identities
# --------------------------------------------------------------------------------------------
def test_annotators_reach_tracked_files_only_as_stable_pseudonyms(project):
    people = [{"id": 7, "email": "alice@example.org"}, "bob@example.org", 7]  # 7: alice again, by her id
    export = [labelling_task(i, [answer(10 * i + k, who, str((i + k) % 2)) for k, who in enumerate(people[:2])], n=2)
              for i in range(4)]  # fmt: skip
    export.append(labelling_task(9, [answer(99, people[2], "0")], n=2))
    (project / "people.json").write_text(json.dumps(export))
    for output in ("first.jsonl", "second.jsonl"):
        done = rlhf("label", "import", "people.json", output, cwd=project)
        assert done.returncode == 0, done.stderr
        assert "example.org" not in done.stdout + done.stderr
    first = (project / "first.jsonl").read_text()
    assert first == (project / "second.jsonl").read_text() and "example.org" not in first
    key = project_key(project)
    names = {json.loads(line)["annotator"] for line in first.splitlines()}
    assert names == {pseudonym("7", key), pseudonym("bob@example.org", key)}
    # the key that makes them stays out of git and DVC in this repository (a project made from it)
    repo = Path(__file__).resolve().parents[1]
    assert subprocess.run(["git", "check-ignore", "-q", KEY_FILE], cwd=repo).returncode == 0
    assert ".rlhf/" in (repo / ".dvcignore").read_text().splitlines()


@pytest.mark.parametrize("forged", ["é" * 64, "\udc80" * 64, "", 7, None])
def test_a_seal_edited_to_any_value_is_a_disagreement_not_a_crash(forged):
    """hypothesis found it: hmac.compare_digest raises on a str with non-ASCII characters, so a seal edited to
    one was a traceback, not exit 3. Seals are compared as bytes."""
    from rlhf_pipeline.project_key import seal_agrees

    payload = {"challenger": "policy@v2.0.0", "verdicts": []}
    assert seal_agrees(payload, b"key", seal(payload, b"key"))
    assert not seal_agrees(payload, b"key", forged)
