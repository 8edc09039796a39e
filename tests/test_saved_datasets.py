"""A saved dataset's folder given to a command (`rlhf export-preferences --input`, `rlhf label export
--queries`, `rlhf label compare --queries`) that is missing, of something else or damaged: one paragraph
naming the folder and what writes it again, exit 1, no traceback, nothing written."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict

from rlhf_pipeline.cli import main
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.label_studio.tasks import export_tasks
from rlhf_pipeline.params.task import TaskParams
from rlhf_pipeline.saved_datasets import read_split
from rlhf_pipeline.side_by_side_sampling import sample_round


@pytest.fixture
def saved(tmp_path) -> Path:
    rows = [{"query": f"Query {i}.", "samples": [f"A {i}.", f"B {i}."], "best": i % 2} for i in range(6)]
    folder = tmp_path / "prefs"
    DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows[:2])}).save_to_disk(folder)
    return folder


def damaged(saved: Path, tmp_path: Path, how: str) -> Path:
    """A copy of ``saved`` broken in one way."""
    if how == "missing":
        return tmp_path / "nowhere"
    if how == "a file":
        (tmp_path / "params.yaml").write_text("seed: 1\n")
        return tmp_path / "params.yaml"
    if how == "an empty folder":
        (tmp_path / "empty").mkdir()
        return tmp_path / "empty"
    if how == "one split":
        return saved / "train"
    copy = tmp_path / how.replace(" ", "_")
    shutil.copytree(saved, copy)
    arrow = next((copy / "train").glob("*.arrow"))
    if how == "an arrow file cut short":
        arrow.write_bytes(arrow.read_bytes()[:1000])
    elif how == "an arrow file gone":
        arrow.unlink()
    elif how == "its index not JSON":
        (copy / "dataset_dict.json").write_text("{")
    elif how == "no test split":
        shutil.rmtree(copy / "test")
        (copy / "dataset_dict.json").write_text('{"splits": ["train"]}')
    return copy


CASES = {
    "missing": "is missing (or is not a folder); `dvc repro preferences` writes it",
    "a file": "is missing (or is not a folder)",
    "an empty folder": "is not a dataset a stage saved, or its files are damaged (FileNotFoundError",
    "one split": "holds one split, not the splits a stage saves ('test' among them): give the folder above it",
    "an arrow file cut short": "is not a dataset a stage saved, or its files are damaged (",  # Arrow or OS error
    "an arrow file gone": "its files are damaged (FileNotFoundError",
    "its index not JSON": "its files are damaged (JSONDecodeError",
    "no test split": "has no split 'test'; its splits are ['train']",
}


@pytest.mark.parametrize("how", list(CASES))
def test_read_split_names_the_folder_and_what_rebuilds_it(saved, tmp_path, how):
    folder = damaged(saved, tmp_path, how)
    with pytest.raises(PipelineError) as error:
        read_split(folder, "test", "dvc repro preferences")
    message = str(error.value)
    assert message.startswith(str(folder)) and CASES[how] in message, message
    assert "\n" not in message and message.endswith("Nothing was written.")


def test_read_split_reads_a_saved_split(saved):
    assert read_split(saved, "test", "dvc repro preferences")["query"] == ["Query 0.", "Query 1."]


def test_another_stage_s_dataset_is_refused_by_its_columns(saved, tmp_path, capsys):
    """`rlhf export-preferences --input data/queries` used to end in datasets' "Column 'samples' doesn't exist"
    traceback."""
    queries = tmp_path / "queries"
    rows = [{"query": "Query.", "query_ids": [1, 2]}]
    DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows)}).save_to_disk(queries)
    with pytest.raises(PipelineError) as error:
        read_split(queries, "test", "dvc repro preferences", columns=("query", "samples", "best"))
    assert str(error.value) == (
        f"{queries} is not the dataset asked for: its 'test' split has no 'samples' or 'best' column (it has "
        "'query', 'query_ids'); the folder `dvc repro preferences` writes has 'query' and 'samples' and 'best'. "
        "Nothing was written."
    )
    assert read_split(saved, "test", "dvc repro preferences", columns=("query", "samples", "best"))["best"] == [0, 1]
    target = tmp_path / "pairs.jsonl"
    with pytest.raises(SystemExit) as exit_:
        main(["export-preferences", str(target), "--input", str(queries)])
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and "is not the dataset asked for" in err and "Traceback" not in err
    assert not target.exists()
    with pytest.raises(PipelineError, match="has no 'query_ids' column"):
        export_tasks(tmp_path / "no_model", saved, TaskParams(), "test", 2, 2, 0, 1)


@pytest.mark.parametrize("how", ["missing", "an arrow file cut short", "its index not JSON"])
def test_export_preferences_refuses_a_bad_input_folder_and_writes_nothing(saved, tmp_path, capsys, how):
    folder, target = damaged(saved, tmp_path, how), tmp_path / "pairs.jsonl"
    with pytest.raises(SystemExit) as exit_:
        main(["export-preferences", str(target), "--input", str(folder), "--split", "test"])
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and "Traceback" not in err
    assert err.startswith(f"rlhf export-preferences: error: {folder} ") and CASES[how].split(";")[0] in err
    assert not target.exists()


@pytest.mark.parametrize("how", ["missing", "an arrow file gone"])
def test_label_export_and_compare_refuse_a_bad_queries_folder_before_loading_a_model(saved, tmp_path, how):
    """Both read the queries first: the model folders here hold nothing, and are never opened."""
    folder, model = damaged(saved, tmp_path, how), tmp_path / "no_model"
    with pytest.raises(PipelineError, match="`dvc repro queries` writes it"):
        export_tasks(model, folder, TaskParams(), "test", 2, 2, 0, 1)
    with pytest.raises(PipelineError, match="`dvc repro queries` writes it"):
        sample_round((str(model), "a"), (str(model), "b"), folder, TaskParams(), 2, 0)
