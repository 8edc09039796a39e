"""Human labels through Label Studio's formats: the labelling interface, tasks sampled from a model,
annotations read back into best-of-N rows that pass the contract, and the refusals (exit 3, nothing
written). The exports here are written the way Label Studio 1.23 writes its JSON export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from rlhf_pipeline.errors import DataContractError
from rlhf_pipeline.label_studio.client import TOKEN_VARIABLE, URL_VARIABLE
from rlhf_pipeline.label_studio.export import pairwise_agreement, rows_from_export
from rlhf_pipeline.label_studio.interface import label_config
from rlhf_pipeline.project_key import project_key, pseudonym

REPO = Path(__file__).resolve().parents[1]
RLHF = [sys.executable, "-m", "rlhf_pipeline.cli"]
KEY = b"a test project's key"


def who(person: int | str, key: bytes = KEY) -> str:
    """The pseudonym an annotator's id becomes under ``key``."""
    return pseudonym(str(person), key)


def test_the_shipped_interfaces_are_the_generated_ones_and_ask_one_required_choice():
    for n, name in ((4, "best_of_4.xml"), (2, "pairwise.xml")):
        assert (REPO / "labelling" / name).read_text() == label_config(n)
        view = ET.fromstring(label_config(n))
        texts = [t.get("value") for t in view.iter("Text")]
        assert texts == ["$query", *(f"$sample{i}" for i in range(n))]
        (choices,) = view.iter("Choices")
        assert choices.get("choice") == "single" and choices.get("required") == "true"
        assert [c.get("alias") for c in choices.iter("Choice")] == [str(i) for i in range(n)]


def task(number: int, annotations: list[dict], n: int = 4) -> dict:
    data = {
        "task_id": f"t{number:04d}",
        "query": f"Query number {number}.",
        **{f"sample{k}": f"response {k} to query {number}" for k in range(n)},
        "split": "train",
        "query_index": number,
        "seed": 0,
        "model": "policy@v1.0.0",
        "model_sha256": "ab" * 32,
        "round": 2,
    }
    return {"id": 100 + number, "data": data, "annotations": annotations}


def answer(annotation_id: int, who: int, choice: str | None, cancelled: bool = False) -> dict:
    result = (
        []
        if choice is None
        else [{"from_name": "best", "to_name": "query", "type": "choices", "value": {"choices": [choice]}}]
    )
    return {"id": annotation_id, "completed_by": who, "result": result, "was_cancelled": cancelled}


def export_of_two_annotators(tasks: int = 40) -> list[dict]:
    """Annotators 1 and 2 label every task; they agree on three tasks in four. Task 0 also has a
    cancelled annotation (annotator 3) and task 1 a submission without a choice (annotator 3)."""
    out = []
    for number in range(tasks):
        first = str(number % 4)
        second = first if number % 4 else str((number + 1) % 4)
        annotations = [answer(10 * number, 1, first), answer(10 * number + 1, 2, second)]
        if number == 0:
            annotations.append(answer(10 * number + 2, 3, "2", cancelled=True))
        if number == 1:
            annotations.append(answer(10 * number + 2, 3, None))
        out.append(task(number, annotations))
    return out


def test_an_export_becomes_one_row_per_annotation_with_who_what_and_where_from():
    report = rows_from_export(export_of_two_annotators(), "export.json", KEY)
    assert len(report.rows) == 80
    row = report.rows[1]
    assert row["annotator"] == who(2) and row["task_id"] == "t0000" and row["round"] == 2
    assert row["model"] == "policy@v1.0.0" and row["best"] == 1  # annotator 2 chose differently on task 0
    assert [row[f"sample{k}"] for k in range(4)] == [f"response {k} to query 0" for k in range(4)]
    summary = report.summary()
    assert summary["cancelled"] == 1 and summary["skipped"] == 1
    assert summary["annotators"] == {who(1): 40, who(2): 40}
    assert who(1) == who(1) != who(1, b"another key")  # stable under one key, unrelated under another
    assert summary["agreement"] == pytest.approx(0.75) and summary["tasks_with_several_annotations"] == 40


def test_agreement_counts_pairs_within_a_task():
    assert pairwise_agreement({"a": [0, 0, 1], "b": [2]}) == (pytest.approx(1 / 3), 1)
    assert pairwise_agreement({"a": [3]}) == (None, 0)


@pytest.mark.parametrize(
    "annotations, message",
    [
        ([answer(1, 1, "4")], rf"annotation 1 by annotator {who(1)}: the choice \['4'\] is not one of the 4 responses"),
        ([answer(1, 1, "best")], r"the choice \['best'\] is not one of the 4 responses"),
        ([answer(1, 1, "0"), answer(2, 1, "3")], f"annotation 2 by annotator {who(1)}: this annotator answered"),
    ],
)
def test_an_annotation_that_cannot_be_a_label_is_refused_by_task_and_annotation(annotations, message):
    with pytest.raises(DataContractError, match=message) as caught:
        rows_from_export([task(0, [answer(9, 2, "1")]), task(7, annotations)], "export.json", KEY)
    assert "export.json: task 107 (task_id t0007)" in str(caught.value)


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*RLHF, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_import_writes_rows_that_pass_the_contract_and_refuses_low_agreement_writing_nothing(tmp_path):
    (tmp_path / "params.yaml").write_text("data:\n  validation:\n    min_rows: 16\n    min_agreement: 0.8\n")
    (tmp_path / "export.json").write_text(json.dumps(export_of_two_annotators()))
    refused = cli("label", "import", "export.json", "labels.jsonl", cwd=tmp_path)
    assert refused.returncode == 3, refused.stderr
    assert "annotators agree on 0.75 of the pairs" in refused.stderr and "below min_agreement 0.8" in refused.stderr
    assert not (tmp_path / "labels.jsonl").exists()

    done = cli("label", "import", "export.json", "labels.jsonl", "--min-agreement", "0.7", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["rows"] == 80
    checked = cli("validate-preferences", "labels.jsonl", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr  # two people, one choice: not a duplicate

    rows = [json.loads(line) for line in (tmp_path / "labels.jsonl").read_text().splitlines()]
    rows[1]["annotator"] = rows[0]["annotator"]  # the same person's second, different answer to task 0
    (tmp_path / "twice.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    twice = cli("validate-preferences", "twice.jsonl", cwd=tmp_path)
    assert twice.returncode == 3 and "one answer per task and annotator" in twice.stdout, twice.stdout

    # an export and a labels file saved with a byte-order mark (Notepad, Excel) read as without one
    (tmp_path / "marked.json").write_bytes(b"\xef\xbb\xbf" + (tmp_path / "export.json").read_bytes())
    marked = cli("label", "import", "marked.json", "marked.jsonl", "--min-agreement", "0.7", cwd=tmp_path)
    assert marked.returncode == 0, marked.stderr
    assert (tmp_path / "marked.jsonl").read_bytes() == (tmp_path / "labels.jsonl").read_bytes()
    (tmp_path / "marked_labels.jsonl").write_bytes(b"\xef\xbb\xbf" + (tmp_path / "labels.jsonl").read_bytes())
    checked = cli("validate-preferences", "marked_labels.jsonl", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.e2e
def test_export_samples_n_responses_per_query_tied_to_model_seed_and_round(tiny_run, tmp_path):
    root = tiny_run[0]
    args = ["label", "export", str(tmp_path / "tasks.json"), "--model", "models/base", "--num", "6", "--seed", "5"]
    made = cli(*args, "--round", "3", "--model-name", "base", cwd=root)
    assert made.returncode == 0, made.stderr
    tasks = json.loads((tmp_path / "tasks.json").read_text())
    assert 4 <= len(tasks) <= 6  # a query whose responses break the contract twice is left out
    data = [t["data"] for t in tasks]
    assert len({d["task_id"] for d in data}) == len(data)
    assert {(d["model"], d["round"], d["seed"], d["split"]) for d in data} == {("base", 3, 5, "train")}
    assert all(len({d[f"sample{k}"] for k in range(4)}) == 4 for d in data)
    # the interface's variables are the task's fields
    assert all(v.get("value")[1:] in data[0] for v in ET.fromstring(label_config(4)).iter("Text"))
    again = cli(*args[:2], str(tmp_path / "again.json"), *args[3:], "--round", "3", "--model-name", "base", cwd=root)
    assert again.returncode == 0 and json.loads((tmp_path / "again.json").read_text()) == tasks  # seeded


def test_rounds_append_to_one_file_deduplicated_by_task_and_annotator(tmp_path):
    """Round 1 then round 2 (two new tasks, one task of round 1 exported again): every round kept
    once; the same export imported twice adds nothing; an edited export is refused, the file kept."""
    (tmp_path / "round1.json").write_text(json.dumps(export_of_two_annotators(3)))
    second = export_of_two_annotators(5)[2:]  # tasks 2 (again), 3 and 4
    (tmp_path / "round2.json").write_text(json.dumps(second))
    first = cli("label", "import", "round1.json", "labels.jsonl", "--append", "--params", "none.yaml", cwd=tmp_path)
    assert first.returncode == 0 and json.loads(first.stdout)["rows"] == 6, first.stderr  # no file yet: written
    for added, already in ((4, 2), (0, 6)):  # round 2, then round 2 again
        done = cli("label", "import", "round2.json", "labels.jsonl", "--append", "--params", "none.yaml", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert (json.loads(done.stdout)["added"], json.loads(done.stdout)["already_there"]) == (added, already)
    rows = [json.loads(line) for line in (tmp_path / "labels.jsonl").read_text().splitlines()]
    assert len(rows) == 10 and len({(r["task_id"], r["annotator"]) for r in rows}) == 10
    before = (tmp_path / "labels.jsonl").read_bytes()
    second[0]["annotations"][0]["result"][0]["value"]["choices"] = ["3"]  # task 2, annotator 1: was 2
    (tmp_path / "edited.json").write_text(json.dumps(second))
    refused = cli("label", "import", "edited.json", "labels.jsonl", "--append", "--params", "none.yaml", cwd=tmp_path)
    annotator = who(1, project_key(tmp_path))
    assert refused.returncode == 3 and f"task_id t0002 by annotator {annotator} is already labelled 2" in refused.stderr
    assert (tmp_path / "labels.jsonl").read_bytes() == before


def test_the_golden_label_set_is_never_an_import_target(tmp_path):
    """promotion.golden_labels is kept apart from every round: importing into it, appended or not, is
    refused (exit 2) and the file stays as it was."""
    (tmp_path / "round1.json").write_text(json.dumps(export_of_two_annotators(3)))
    (tmp_path / "params.yaml").write_text("promotion:\n  golden_labels: data/labels/golden.jsonl\n")
    golden = tmp_path / "data/labels/golden.jsonl"
    golden.parent.mkdir(parents=True)
    golden.write_text('{"query": "q", "sample0": "a", "sample1": "b", "best": 0}\n')
    for extra in (["--append"], []):
        refused = cli("label", "import", "round1.json", "data/labels/golden.jsonl", *extra, cwd=tmp_path)
        assert refused.returncode == 2 and "is promotion.golden_labels" in refused.stderr, refused.stderr
    assert golden.read_text() == '{"query": "q", "sample0": "a", "sample1": "b", "best": 0}\n'
    kept = cli("label", "import", "round1.json", "data/labels/human.jsonl", "--append", cwd=tmp_path)
    assert kept.returncode == 0, kept.stderr


def test_from_server_needs_the_address_and_token_from_the_environment(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (URL_VARIABLE, TOKEN_VARIABLE)}
    pulled = subprocess.run(
        [*RLHF, "label", "import", "--from-server", "3", "labels.jsonl"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert pulled.returncode == 2, pulled.stderr
    assert f"{URL_VARIABLE} and {TOKEN_VARIABLE} are not set" in pulled.stderr
    assert "Traceback" not in pulled.stderr and not (tmp_path / "labels.jsonl").exists()
    both = cli("label", "import", "export.json", cwd=tmp_path)
    assert both.returncode == 2 and "takes INPUT OUTPUT" in both.stderr, both.stderr


@pytest.mark.e2e
def test_export_refuses_queries_another_tokenizer_made(tiny_run, tmp_path):
    """Queries of another base model's project (ids beyond this model's vocabulary, as Gemma's 262k
    ids are for SmolLM2) are refused with both sizes, not an index error inside the model."""
    from datasets import load_from_disk

    root = tiny_run[0]
    queries = load_from_disk(str(root / "data" / "queries"))
    queries.map(lambda row: {"query_ids": [i + 300_000 for i in row["query_ids"]]}).save_to_disk(tmp_path / "q")
    made = cli("label", "export", str(tmp_path / "t.json"), "--model", "models/base", "--queries", str(tmp_path / "q"),
               "--num", "2", cwd=root)  # fmt: skip
    assert made.returncode == 1 and "was tokenized for another model: its token ids reach 3" in made.stderr, made.stderr
    assert "Traceback" not in made.stderr and not (tmp_path / "t.json").exists()
