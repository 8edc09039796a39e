"""One labelling round against the real Label Studio (installed by `make label-studio`; skipped with
the reason where it is absent): tasks sampled from the current policy go into a project with the
shipped interface, two people answer them (one task through the real labelling page in headless
Chromium, the rest through the API with each person's own token), and the retrain flow pulls the
annotations from the server, checks them against the contract and retrains the tiny pipeline on
them; lineage then says which rows came from which round and model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from label_studio_server import LABEL_STUDIO, NOT_INSTALLED, label_in_browser, start_label_studio, stop
from system_packages import unavailable
from test_pipeline_e2e import sh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `flows` lives at the repo root

from flows.retrain.flow import retrain  # noqa: E402
from rlhf_pipeline.label_studio.client import TOKEN_VARIABLE, URL_VARIABLE  # noqa: E402
from rlhf_pipeline.label_studio.interface import weights_sha256  # noqa: E402
from rlhf_pipeline.project_key import project_key, pseudonym  # noqa: E402

pytestmark = pytest.mark.e2e  # a real Label Studio server

REPO = Path(__file__).resolve().parents[1]
RLHF = [sys.executable, "-m", "rlhf_pipeline.cli"]
TASKS, ROUND, LABELS = 8, 2, "data/labels/human.jsonl"


@pytest.fixture(scope="module")
def label_studio(tmp_path_factory):
    if not LABEL_STUDIO.exists():
        unavailable(NOT_INSTALLED)
    server = start_label_studio(tmp_path_factory.mktemp("label-studio"))
    yield server
    stop(server.process)


def rlhf(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **env}
    return subprocess.run([*RLHF, *args], cwd=cwd, capture_output=True, text=True, timeout=600, env=env)


def test_a_round_through_label_studio_retrains_the_tiny_pipeline(
    label_studio, chromium, tiny_run, prefect_server, tmp_path, monkeypatch
):
    root = tmp_path / "project"
    shutil.copytree(tiny_run[0], root, symlinks=True)
    made = rlhf("label", "export", "tasks.json", "--model", "models/policy", "--num", str(TASKS), "--seed", "3",
                "--round", str(ROUND), cwd=root)  # fmt: skip
    assert made.returncode == 0, made.stderr
    tasks = json.loads((root / "tasks.json").read_text())
    assert len(tasks) >= TASKS - 2

    server = label_studio
    config = (REPO / "labelling" / "best_of_4.xml").read_text()
    project = server.create_project("tiny round 2", config, annotators_per_task=2)
    task_ids = server.import_tasks(project, tasks)
    assert len(task_ids) == len(tasks)
    second = server.sign_up("second.annotator@example.com", "a-long-password-1")

    # the second person answers one task in the real page: ticks Response 3 (index 2) and submits
    shot = label_in_browser(chromium, server, project, second, "Response 3")
    assert shot.startswith(b"\x89PNG")
    by_browser = server.annotations_by(project, second)
    assert len(by_browser) == 1, by_browser
    clicked_task, clicked = by_browser[0]
    # what the page stores is the choice's alias: the response's index, not its label
    assert clicked["result"][0]["value"] == {"choices": ["2"]} and not clicked["was_cancelled"]

    # the rest through the API, each person with their own token; they disagree on every third task
    expected = {}
    for number, task in enumerate(task_ids):
        first_choice = number % 4
        second_choice = 2 if task == clicked_task else (first_choice if number % 3 else (first_choice + 1) % 4)
        server.annotate(task, str(first_choice), server.admin)
        if task != clicked_task:
            server.annotate(task, str(second_choice), second)
        expected[task] = (first_choice, second_choice)
    agree = sum(a == b for a, b in expected.values()) / len(expected)

    # the round: the flow pulls the project (address and token from the environment), validates, retrains
    params_path = root / "params.yaml"
    params = yaml.safe_load(params_path.read_text())
    params["data"]["preferences"]["source"] = LABELS
    params["data"]["validation"]["min_rows"] = 4
    # a round of a dozen tasks holds out two or three: their label share says nothing (which tasks are held
    # out depends on the samples, so on the CPU)
    params["data"]["validation"]["max_label_share"] = 1.0
    params["labelling"] = {"source": "label_studio", "label_studio_project": project}
    params_path.write_text(yaml.safe_dump(params, sort_keys=False))
    monkeypatch.setenv(URL_VARIABLE, server.url)
    monkeypatch.setenv(TOKEN_VARIABLE, server.personal_access_token(second))  # 1.23's default kind of token
    state = retrain(repo=str(root), push=False, return_state=True, retry_delay_seconds=0.1)
    assert state.is_completed(), state.message
    report = state.result()
    assert report["pulled"]["rows"] == 2 * len(task_ids) and report["pulled"]["agreement"] == pytest.approx(agree)
    assert {"preferences", "train_reward", "train_policy", "evaluate"} <= {
        s["stage"] for s in report["stages"] if s["result"] == "ran"
    }

    rows = [json.loads(line) for line in (root / LABELS).read_text().splitlines()]
    assert len(rows) == 2 * len(task_ids)
    key = project_key(root)  # people are named by their pseudonyms under the project's key, never by id or e-mail
    assert {r["annotator"] for r in rows} == {pseudonym(str(server.admin.id), key), pseudonym(str(second.id), key)}
    assert {r["round"] for r in rows} == {ROUND} and {r["model"] for r in rows} == {"models/policy"}
    by_task = {t["data"]["task_id"]: t["id"] for t in server.export(project)}
    for row in rows:
        first_choice, second_choice = expected[by_task[row["task_id"]]]
        by_admin = row["annotator"] == pseudonym(str(server.admin.id), key)
        assert row["best"] == (first_choice if by_admin else second_choice)
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    assert LABELS in {d["path"] for d in lock["stages"]["preferences"]["deps"]} or any(
        d["path"] == "data/labels" for d in lock["stages"]["preferences"]["deps"]
    )
    provenance = json.loads((root / "data" / "preferences" / "format.json").read_text())
    (entry,) = provenance["rounds"]
    assert entry["round"] == ROUND and entry["rows"] == len(rows) and entry["annotators"] == 2
    assert entry["tasks"] == len(task_ids) and entry["model"] == ["models/policy"]

    # lineage of the retrained policy says where its labels came from
    lineage = rlhf("lineage", "models/policy", cwd=root)
    assert lineage.returncode == 0, lineage.stderr
    assert f"round {ROUND}: {len(rows)} rows ({len(task_ids)} tasks, 2 annotators), sampled by models/policy" in (
        lineage.stdout
    )

    # the next round's pull finds nothing new: every row kept once (test_flow checks that an unchanged
    # file is not ingested again)
    again = rlhf("label", "import", "--from-server", str(project), LABELS, "--append", cwd=root)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["added"] == 0 and json.loads(again.stdout)["already_there"] == len(rows)
    assert len((root / LABELS).read_text().splitlines()) == len(rows)

    # the next round samples the version the flow registered: fetched and checked into a scratch folder
    # that is gone afterwards, and named by its tag; an unknown version is one paragraph
    made = rlhf("label", "export", "round3.json", "--model", "policy@latest", "--num", "4", "--round", "3", cwd=root)
    assert made.returncode == 0, made.stderr
    data = [t["data"] for t in json.loads((root / "round3.json").read_text())]
    assert {d["model"] for d in data} == {"policy@v1.0.0"} and {d["round"] for d in data} == {3}
    assert {d["model_sha256"] for d in data} == {weights_sha256(root / "models" / "policy")}
    assert not list(root.glob(".label-export-*"))
    missing = rlhf("label", "export", "tasks2.json", "--model", "policy@v9", cwd=root)
    # a version that is not registered: exit 2 (a name no retry makes right), as every registry name
    assert missing.returncode == 2 and "policy has no version v9.0.0" in missing.stderr, missing.stderr


def test_a_refused_token_or_a_missing_project_is_one_paragraph_and_writes_nothing(label_studio, tmp_path):
    cases = (
        ("1", "f" * 40, 2, "refused the token in LABEL_STUDIO_API_KEY (HTTP 401)"),  # a legacy token
        ("1", "aaa.bbb.ccc", 2, "refused the token in LABEL_STUDIO_API_KEY (HTTP 401)"),  # a personal access token
        ("999", label_studio.admin.token, 2, "Label Studio project 999 at http://127.0.0.1:"),
    )
    for project, token, code, message in cases:
        pulled = rlhf("label", "import", "--from-server", project, "labels.jsonl", cwd=tmp_path,
                      **{URL_VARIABLE: label_studio.url, TOKEN_VARIABLE: token})  # fmt: skip
        assert pulled.returncode == code and message in pulled.stderr, pulled.stderr
        assert "Traceback" not in pulled.stderr and token not in pulled.stderr + pulled.stdout
        assert not (tmp_path / "labels.jsonl").exists()


def test_people_judge_a_challenger_side_by_side_through_label_studio_both_ways(
    label_studio, chromium, tiny_run, prefect_server, tmp_path, monkeypatch
):
    """promotion.score: human with the real server: a retrain run registers the challenger, sends its
    blind tasks to the project and ends; two people answer (one task in the real page, the rest through
    the API); the next run pulls their answers and decides. A second project answered the other way
    keeps the version out of prod (there through `rlhf label verdicts --from-server` and `rlhf models gate`,
    the commands a person runs: the gate itself only reads the round and decides)."""
    server = label_studio
    second = server.sign_up("judge.two@example.com", "a-long-password-2")
    config = (REPO / "labelling" / "side_by_side.xml").read_text()
    projects = [server.create_project(f"side by side {way}", config, annotators_per_task=2) for way in "ab"]
    roots = [tmp_path / "promoted", tmp_path / "refused"]
    shutil.copytree(tiny_run[0], roots[0], symlinks=True)
    env = {URL_VARIABLE: server.url, TOKEN_VARIABLE: server.personal_access_token(second)}

    def set_project(root: Path, project: int) -> None:
        params = yaml.safe_load((root / "params.yaml").read_text())
        human = {"num_queries": 6, "min_judgements": 10, "min_annotators": 2, "label_studio_project": project}
        params["promotion"] = {**params["promotion"], "score": "human", "judge": None, "max_kl": None,
                               "min_queries": 2, "human": human}  # fmt: skip
        (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))

    def gate(root: Path, project: int) -> dict:
        pulled = rlhf("label", "verdicts", "--from-server", str(project), cwd=root, **env)
        assert pulled.returncode == 0, pulled.stderr
        ran = rlhf("models", "gate", "--json", cwd=root, **env)
        assert ran.returncode == 0, ran.stderr
        return json.loads(ran.stdout)

    def run_flow(root: Path) -> str:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        state = retrain(repo=str(root), push=False, return_state=True, retry_delay_seconds=0.1)
        assert state.is_completed(), state.message
        report = state.result()
        assert not [s for s in report["stages"] if s["result"] == "ran"]  # nothing stale: the gate alone
        return report["promotion"]

    set_project(roots[0], projects[0])
    sent = run_flow(roots[0])
    assert f"tasks sent to Label Studio project {projects[0]}" in sent and prod_of(roots[0]) is None
    (round_file,) = (roots[0] / "side_by_side").glob("*.json")
    assert round_file.name == "policy@v1.0.0_vs_models-base.json"
    assert "side_by_side/" in subprocess.run(["git", "show", "--stat", "HEAD"], cwd=roots[0], capture_output=True,
                                             text=True).stdout  # fmt: skip
    order = json.loads(round_file.read_text())["order"]
    exported = tasks_in(server, projects[0])
    assert len(exported) == len(order) >= 5
    assert all("challenger" not in json.dumps(t["data"]) and "incumbent" not in json.dumps(t["data"]) for t in exported)
    # the other way: the same round, its tasks in a second project
    shutil.copytree(roots[0], roots[1], symlinks=True)
    set_project(roots[1], projects[1])
    server.import_tasks(projects[1], [{"data": t["data"]} for t in exported])

    def answer(project: int, prefers: str, clicked: int | None = None) -> None:
        """Both people prefer ``prefers``'s response on every task (the second person's ``clicked`` task
        was answered in the page already)."""
        for task_id, task in {t["data"]["task_id"]: t["id"] for t in tasks_in(server, project)}.items():
            mine = "a" if (order[task_id] == "challenger") == (prefers == "challenger") else "b"
            server.annotate(task, mine, server.admin)
            if task != clicked:
                server.annotate(task, mine, second)

    # the second person answers one task in the real page (A); one answer is too few: pulled, the gate waits
    assert label_in_browser(chromium, server, projects[0], second, "A").startswith(b"\x89PNG")
    ((clicked, annotation),) = server.annotations_by(projects[0], second)
    assert annotation["result"][0]["value"] == {"choices": ["a"]}
    waits = gate(roots[0], projects[0])
    assert (
        waits["waiting"] and "1 verdict from 1 person; the rule needs at least 10 from at least 2" in waits["outcome"]
    )
    assert prod_of(roots[0]) is None

    # the rest through the API: both prefer the challenger; the next run pulls, decides, promotes
    answer(projects[0], "challenger", clicked)
    assert run_flow(roots[0]) == "policy@v1.0.0 assigned prod (with reward-model@v1.0.0)"
    assert prod_of(roots[0]) == "policy@v1.0.0"
    promoted = gate(roots[0], projects[0])  # decided: the command now finds nothing new, and prints the decision again
    assert promoted["decision"] is None and "no new version" in promoted["outcome"]
    verdicts = json.loads(round_file.read_text())["verdicts"]
    assert len(verdicts) == 2 * len(order)
    assert sum(v["annotator"] == pseudonym(str(second.id), project_key(roots[0])) for v in verdicts) == len(order)

    # the other project: both prefer the base model's responses; the version stays out of prod
    answer(projects[1], "incumbent")
    refused = gate(roots[1], projects[1])
    assert refused["decision"]["promote"] is False and "stays below 50%" in refused["markdown"]
    assert "prod stays unassigned" in refused["outcome"] and prod_of(roots[1]) is None


def tasks_in(server, project: int) -> list[dict]:
    """Every task of ``project``, answered or not (the export holds only the answered ones)."""
    return server.api("GET", "/api/tasks/", params={"project": project, "page_size": 1000}).json()["tasks"]


def prod_of(root: Path) -> str | None:
    return sh(["gto", "show", "policy#prod", "--ref"], root, check=False).stdout.strip() or None
