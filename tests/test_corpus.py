"""Corpus sources: local .txt/.jsonl/.parquet files, hub ids (offline), and generated passages."""

from __future__ import annotations

import json
import time

import pandas as pd
import pytest
from conftest import run_stage_script

from rlhf_pipeline.corpus import (
    clean_passages,
    encode_prompt,
    generate_passages,
    load_hub_passages,
    load_local_passages,
    topic_prompts,
)
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.io import is_local_source


def test_txt_one_passage_per_line_without_blank_lines(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("First passage.\nSecond passage.\n\n")
    assert clean_passages(load_local_passages(str(path), "text"), str(path)) == ["First passage.", "Second passage."]


def test_txt_paragraphs_separated_by_blank_lines(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("A first\nparagraph.\n\n\n  \nSecond one.\nStill second.\n")
    assert load_local_passages(str(path), "text") == ["A first paragraph.", "Second one. Still second."]


def test_jsonl_and_parquet_text_column(tmp_path):
    rows = [{"body": "One.", "id": 1}, {"body": "  ", "id": 2}, {"body": None, "id": 3}, {"body": "Two.", "id": 4}]
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    parquet = tmp_path / "c.parquet"
    pd.DataFrame(rows).to_parquet(parquet)
    for path in (jsonl, parquet):
        assert clean_passages(load_local_passages(str(path), "body"), str(path)) == ["One.", "Two."]


def test_missing_column_names_the_columns(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"body": "x", "id": 1}) + "\n")
    with pytest.raises(PipelineError, match=r"'text'.*\['body', 'id'\]"):
        load_local_passages(str(path), "text")


def test_missing_file_and_empty_corpus(tmp_path):
    with pytest.raises(PipelineError, match="not found"):
        load_local_passages(str(tmp_path / "nope.txt"), "text")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(PipelineError, match="no non-empty passage"):
        clean_passages(load_local_passages(str(empty), "text"), str(empty))
    with pytest.raises(PipelineError, match="unsupported"):
        (tmp_path / "c.csv").write_text("a\n")
        load_local_passages(str(tmp_path / "c.csv"), "text")
    with pytest.raises(PipelineError, match=rf"^data.corpus.source: {tmp_path} is a folder; give a .txt, .jsonl or"):
        load_local_passages(str(tmp_path), "text")
    for rows in ("", "{}\n{}\n"):  # was: "column 'text' is not in ...; its columns are []"
        (tmp_path / "e.jsonl").write_text(rows)
        with pytest.raises(PipelineError, match="e.jsonl holds no data: no row with any column"):
            load_local_passages(str(tmp_path / "e.jsonl"), "text")


def test_hub_id_offline_fails_fast_and_clearly():
    assert not is_local_source("someone/some-corpus") and is_local_source("data/raw/x.txt")
    start = time.monotonic()
    with pytest.raises(PipelineError, match="HF_DATASETS_OFFLINE"):
        load_hub_passages("rlhf-pipeline-test/does-not-exist", "train", "text")
    assert time.monotonic() - start < 30


def test_topic_prompts_are_a_few_hundred_distinct():
    prompts = topic_prompts()
    assert 200 <= len(prompts) == len(set(prompts))


def test_prompt_encoding_without_chat_template(tiny_tokenizer):
    assert tiny_tokenizer.decode(encode_prompt(tiny_tokenizer, "Hi.")) == "Hi.\n"


def test_generated_is_deterministic_per_seed(tiny_model, tiny_tokenizer):
    run = lambda seed: generate_passages(tiny_model, tiny_tokenizer, 7, 12, 1.0, 3, seed)  # noqa: E731
    first = run(5)
    assert len(first) == 7 and all(isinstance(t, str) for t in first)
    assert run(5) == first
    assert run(6) != first


@pytest.mark.e2e
def test_corpus_stage_generated(project):
    project.write_params(**{"data.corpus.num_passages": 5, "data.corpus.batch_size": 2})
    assert run_stage_script("corpus") == 0
    from datasets import load_from_disk

    corpus = load_from_disk(str(project / "data" / "corpus"))
    assert corpus.column_names == ["text"] and 0 < len(corpus) <= 5


@pytest.mark.e2e
def test_corpus_stage_reports_missing_file(project, capsys):
    project.write_params(**{"data.corpus.source": "data/raw/missing.jsonl"})
    assert run_stage_script("corpus") == 1
    assert "data/raw/missing.jsonl not found" in capsys.readouterr().err
    assert not (project / "data" / "corpus").exists()


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_a_byte_order_mark_opening_a_file_is_skipped_not_read_as_text(tmp_path, suffix):
    """Notepad and Excel save UTF-8 with a byte-order mark: json.loads refused the first line ("Unexpected
    UTF-8 BOM") and a .txt corpus kept U+FEFF as its first passage's first character. One inside a text
    stays, for the data contract's invisible-character rule to see."""
    plain, marked = tmp_path / f"plain{suffix}", tmp_path / f"marked{suffix}"
    if suffix == ".txt":
        plain.write_text("First passage.\nSecond \ufeffpassage.\n")
    else:
        plain.write_text(json.dumps({"text": "First passage."}) + "\n" + json.dumps({"text": "Second \ufeffpassage."}))
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    passages = load_local_passages(str(marked), "text")
    assert passages == load_local_passages(str(plain), "text") == ["First passage.", "Second \ufeffpassage."]
