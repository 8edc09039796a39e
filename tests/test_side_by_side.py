"""Side-by-side human evaluation (rlhf_pipeline/side_by_side.py): blind tasks out of two models, people's
A/B/tie answers back in as verdicts of their round. The gate reading them on a real project:
tests/test_registry.py; through a real Label Studio: tests/test_label_studio.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from datasets import Dataset, DatasetDict
from test_preferences import tiny_queries

from rlhf_pipeline.errors import DataContractError, PipelineError
from rlhf_pipeline.io import write_checksums
from rlhf_pipeline.label_studio.client import TOKEN_VARIABLE, URL_VARIABLE
from rlhf_pipeline.models import load_causal_lm, load_tokenizer
from rlhf_pipeline.params.task import TaskParams
from rlhf_pipeline.project_key import project_key, pseudonym
from rlhf_pipeline.side_by_side import (
    CHALLENGER,
    INCUMBENT,
    TASK_FIELDS,
    TIE,
    label_config,
    load_round,
    read_verdicts,
    tally,
)
from rlhf_pipeline.side_by_side_sampling import sample_round

REPO = Path(__file__).resolve().parents[1]
TASK = TaskParams(response_length=8, truncate_after=4)


def test_the_shipped_interface_is_the_generated_one_and_asks_a_b_or_tie():
    assert (REPO / "labelling" / "side_by_side.xml").read_text() == label_config()
    view = ET.fromstring(label_config())
    assert [t.get("value") for t in view.iter("Text")] == ["$query", "$response_a", "$response_b"]
    (choices,) = view.iter("Choices")
    assert choices.get("choice") == "single" and choices.get("required") == "true"
    assert [(c.get("value"), c.get("alias")) for c in choices.iter("Choice")] == [("A", "a"), ("B", "b"), ("tie", TIE)]


@pytest.fixture(scope="module")
def two_models(tiny_base_dir, tmp_path_factory):
    """(queries folder, the tiny base, a copy whose output layer is perturbed: another policy)."""
    root = tmp_path_factory.mktemp("side_by_side")
    other = root / "other"
    model, tokenizer = load_causal_lm(tiny_base_dir), load_tokenizer(tiny_base_dir)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.add_(torch.randn(head.shape, generator=torch.Generator().manual_seed(0)) * 0.5)
    model.save_pretrained(other)
    tokenizer.save_pretrained(other)
    write_checksums(other)
    ids, texts = tiny_queries(tokenizer, 24)
    rows = {"query_ids": ids, "query": texts}
    DatasetDict({"train": Dataset.from_dict(rows), "test": Dataset.from_dict(rows)}).save_to_disk(root / "queries")
    return root / "queries", tiny_base_dir, other


def answered(tasks: list[dict], round_, answer) -> list[dict]:
    """A Label Studio export of ``tasks``: each (annotator, choice) that ``answer(challenger_is_a)`` gives."""
    export = []
    for number, task in enumerate(tasks):
        a_is_challenger = round_.order[task["data"]["task_id"]] == CHALLENGER
        annotations = [
            {"id": 10 * number + k, "completed_by": who, "was_cancelled": False,
             "result": [{"from_name": "best", "to_name": "query", "type": "choices", "value": {"choices": [choice]}}]}
            for k, (who, choice) in enumerate(answer(a_is_challenger))
        ]  # fmt: skip
        export.append({"id": number + 1, "data": task["data"], "annotations": annotations})
    return export


def test_a_round_is_blind_recorded_and_read_back_as_verdicts(two_models, tmp_path):
    queries, challenger, incumbent = two_models
    tasks, round_ = sample_round(
        (str(challenger), "policy@v2.0.0"), (str(incumbent), "policy@v1.0.0"), queries, TASK, 24, 5
    )
    assert 20 <= len(tasks) <= 24 and round_.name == "policy@v2.0.0_vs_policy@v1.0.0"
    for task in tasks:
        data = task["data"]
        # the task names both versions, in name order, and nothing that says which wrote A
        assert set(data) == {*TASK_FIELDS, "query_index", "seed"} and data["seed"] == 5
        assert data["versions"] == ["policy@v1.0.0", "policy@v2.0.0"]
        assert data["sha256"] == [round_.incumbent_sha256, round_.challenger_sha256]
        assert CHALLENGER not in json.dumps(data) and INCUMBENT not in json.dumps(data)
    assert set(round_.order.values()) == {CHALLENGER, INCUMBENT}  # drawn per task (both, among 20+)

    # the same seed samples the same responses; the order is drawn again, and the round says which is whose
    again, other_round = sample_round(
        (str(challenger), "policy@v2.0.0"), (str(incumbent), "policy@v1.0.0"), queries, TASK, 24, 5
    )

    def challengers_responses(tasks_, record):
        whose_a = {t["data"]["task_id"]: record.order[t["data"]["task_id"]] for t in tasks_}
        return {
            t["data"]["query_index"]: t["data"][
                "response_a" if whose_a[t["data"]["task_id"]] == CHALLENGER else "response_b"
            ]
            for t in tasks_
        }

    assert challengers_responses(tasks, round_) == challengers_responses(again, other_round)

    # people answer: ann1 always prefers the challenger's response; ann2 says tie where it is A, else prefers the other
    round_.save(tmp_path)
    export = answered(
        tasks, round_, lambda a_is_c: [("ann1", "a" if a_is_c else "b"), ("ann2", TIE if a_is_c else "a")]
    )
    rounds, report = read_verdicts(export, "export.json", tmp_path)
    (record,) = rounds
    record.save(tmp_path)
    counted = tally(load_round(tmp_path / "side_by_side" / f"{round_.name}.json").verdicts, 0.5, 0.95)
    ann2_ties = sum(1 for t in tasks if round_.order[t["data"]["task_id"]] == CHALLENGER)
    assert counted.n == 2 * len(tasks) and counted.ties == ann2_ties
    assert counted.wins == len(tasks) and counted.losses == len(tasks) - ann2_ties
    key = project_key(tmp_path)
    assert counted.annotators == {pseudonym("ann1", key): len(tasks), pseudonym("ann2", key): len(tasks)}
    assert "ann1" not in (tmp_path / "side_by_side" / f"{round_.name}.json").read_text()
    assert report.summary()["added"] == {round_.name: 2 * len(tasks)} and report.agreement == 0.0

    # the same export again adds nothing; one whose answer changed is refused, nothing written
    assert read_verdicts(export, "export.json", tmp_path)[1].already_there == 2 * len(tasks)
    changed = json.loads(json.dumps(export))
    changed[0]["annotations"][0]["result"][0]["value"]["choices"] = [TIE]
    with pytest.raises(DataContractError, match="already recorded as challenger .* this export says tie"):
        read_verdicts(changed, "export.json", tmp_path)


@pytest.fixture(scope="module")
def small_round(two_models):
    queries, challenger, incumbent = two_models
    return sample_round((str(challenger), "c"), (str(incumbent), "i"), queries, TASK, 4, 0)


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda t: t["annotations"][0]["result"][0]["value"].update(choices=["c"]), "is not a, b or tie"),
        (lambda t: t["annotations"].append(dict(t["annotations"][0], id=99)), "answered the task twice"),
        (lambda t: t["data"].update(comparison="policy@v9.0.0_vs_policy@v1.0.0"), "has no round file"),
        (lambda t: t["data"].update(query_index=99), "differ from what"),
        (lambda t: t["data"].pop("sha256"), "lacks sha256"),
        (lambda t: t["data"].update(response_a="\x00"), "response_a fails the contract's text rule"),
    ],
)
def test_an_answer_or_task_that_cannot_be_a_verdict_is_refused_naming_it(small_round, tmp_path, edit, words):
    tasks, round_ = json.loads(json.dumps(small_round[0])), small_round[1]
    round_.save(tmp_path)
    export = answered(tasks, round_, lambda a_is_c: [("ann1", "a")])
    edit(export[-1])
    with pytest.raises(DataContractError, match=words) as refused:
        read_verdicts(export, "export.json", tmp_path)
    assert "export.json: task" in str(refused.value)


def test_the_commands_write_the_tasks_the_round_and_the_verdicts(two_models, tmp_path):
    """`rlhf label compare` and `rlhf label verdicts`, as a person runs them in a project."""
    queries, challenger, incumbent = two_models
    shutil.copytree(queries, tmp_path / "data" / "queries")
    # the two models inside the project: a folder outside it is refused (tests/test_hostile_doors.py)
    challenger = shutil.copytree(challenger, tmp_path / "models" / "challenger").relative_to(tmp_path)
    incumbent = shutil.copytree(incumbent, tmp_path / "models" / "incumbent").relative_to(tmp_path)
    (tmp_path / "params.yaml").write_text(
        "compute: {cpu_numerics: native, cpu_threads: 1}\ntask: {response_length: 8, truncate_after: 4}\n"
    )
    rlhf = [sys.executable, "-m", "rlhf_pipeline.cli", "label"]
    made = subprocess.run([*rlhf, "compare", str(challenger), str(incumbent), "tasks.json", "--num", "6"],
                          cwd=tmp_path, capture_output=True, text=True)  # fmt: skip
    assert made.returncode == 0, made.stderr
    name = f"{challenger}_vs_{incumbent}".replace("/", "-")
    assert f"kept in side_by_side/{name}.json" in made.stdout
    tasks, round_ = (
        json.loads((tmp_path / "tasks.json").read_text()),
        load_round(tmp_path / "side_by_side" / f"{name}.json"),
    )
    (tmp_path / "export.json").write_text(json.dumps(answered(tasks, round_, lambda a_is_c: [("7", "b")])))
    read = subprocess.run([*rlhf, "verdicts", "export.json"], cwd=tmp_path, capture_output=True, text=True)
    assert read.returncode == 0, read.stderr
    assert json.loads(read.stdout)["added"] == {name: len(tasks)}
    verdicts = load_round(tmp_path / "side_by_side" / f"{name}.json").verdicts
    assert [v["winner"] for v in verdicts] == [
        INCUMBENT if round_.order[v["task_id"]] == CHALLENGER else CHALLENGER for v in verdicts
    ]
    missing = subprocess.run([*rlhf, "verdicts"], cwd=tmp_path, capture_output=True, text=True)
    assert missing.returncode == 2 and "--from-server PROJECT" in missing.stderr
    neither = subprocess.run([*rlhf, "compare", str(incumbent), str(challenger)], cwd=tmp_path, capture_output=True,
                             text=True)  # fmt: skip
    assert neither.returncode == 2 and "--send PROJECT" in neither.stderr
    # a send the server refuses leaves no round to wait on: the flow's next run samples and sends it again
    nowhere = {**os.environ, URL_VARIABLE: "http://127.0.0.1:9", TOKEN_VARIABLE: "secret-token-of-1"}
    unsent = subprocess.run([*rlhf, "compare", str(incumbent), str(challenger), "--send", "3", "--num", "6"],
                            cwd=tmp_path, capture_output=True, text=True, env=nowhere)  # fmt: skip
    assert unsent.returncode != 0 and "did not answer" in unsent.stderr and "no task was sent" in unsent.stderr
    assert "Traceback" not in unsent.stderr
    assert "secret-token-of-1" not in unsent.stdout + unsent.stderr
    assert [p.name for p in (tmp_path / "side_by_side").glob("*.json")] == [f"{name}.json"]


def test_a_model_is_not_compared_with_itself_nor_sampled_from_queries_another_tokenizer_made(two_models, tmp_path):
    queries, challenger, _ = two_models
    with pytest.raises(PipelineError, match="both sides are policy@v2.0.0"):
        sample_round((str(challenger), "policy@v2.0.0"), (str(challenger), "policy@v2.0.0"), queries, TASK, 2, 0)
    from datasets import load_from_disk

    shifted = load_from_disk(str(queries)).map(lambda row: {"query_ids": [i + 300_000 for i in row["query_ids"]]})
    shifted.save_to_disk(tmp_path / "q")
    with pytest.raises(PipelineError, match="was tokenized for another model"):
        sample_round((str(challenger), "c"), (str(challenger), "i"), tmp_path / "q", TASK, 2, 0)
