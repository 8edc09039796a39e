"""Query preprocessing (OAI lm_tasks rules) on hand-worked token lists, and the queries stage."""

from __future__ import annotations

import pytest
from conftest import run_stage_script

from rlhf_pipeline.queries import (
    BAD_TEXT,
    NO_END,
    NO_START,
    NOTHING_AFTER_START,
    build_queries,
    find_subsequence,
    pad_tokens,
    preprocess_query,
    rfind_subsequence,
    split_indices,
)
from rlhf_pipeline.tokens import special_prefix, without_prefix

DOT = [9]


def test_start_and_end_single_token():
    # "a . b c . d e" -> after the first '.', truncate to 4, cut after the last '.'
    tokens = [1, 9, 2, 3, 9, 4, 5]
    assert preprocess_query(tokens, DOT, DOT, 4) == ([2, 3, 9], None)


def test_truncation_happens_before_the_end_search():
    # the only '.' after the start lies beyond query_length -> no end within the window
    tokens = [9, 1, 2, 3, 4, 9]
    assert preprocess_query(tokens, DOT, DOT, 4) == (None, NO_END)
    assert preprocess_query(tokens, DOT, DOT, 5) == ([1, 2, 3, 4, 9], None)


def test_end_is_the_last_occurrence_in_the_window():
    tokens = [9, 1, 9, 2, 9, 3]
    assert preprocess_query(tokens, DOT, DOT, 10) == ([1, 9, 2, 9], None)


def test_no_start_token_drops():
    assert preprocess_query([1, 2, 3], DOT, None, 4) == (None, NO_START)


def test_start_token_at_the_very_end_drops():
    # OAI would keep the whole passage here (first_index == len(tokens)); the spec drops it.
    assert preprocess_query([1, 2, 9], DOT, None, 4) == (None, NOTHING_AFTER_START)


def test_no_end_token_drops():
    assert preprocess_query([9, 1, 2, 3], DOT, DOT, 8) == (None, NO_END)


def test_passage_shorter_than_query_length_is_kept_whole():
    assert preprocess_query([9, 1, 9], DOT, DOT, 16) == ([1, 9], None)


def test_multi_token_start_and_end():
    start, end = [7, 8], [5, 6]
    tokens = [1, 7, 2, 7, 8, 3, 5, 6, 4, 5, 6, 1, 7, 8]
    # first full [7, 8] at index 3 -> keep [3, 5, 6, 4, 5, 6, 1, 7, 8]; truncate to 8; last [5, 6] ends at 6
    assert preprocess_query(tokens, start, end, 8) == ([3, 5, 6, 4, 5, 6], None)
    # a partial match of the start sequence is not a match
    assert preprocess_query([1, 7, 2, 3], start, None, 8) == (None, NO_START)


def test_both_rules_disabled_only_truncates():
    assert preprocess_query([1, 2, 3, 4, 5], None, None, 3) == ([1, 2, 3], None)
    assert preprocess_query([], None, None, 3) == (None, "empty")


def test_only_end_rule():
    assert preprocess_query([1, 9, 2, 9, 3], None, DOT, 4) == ([1, 9, 2, 9], None)


def test_subsequence_search():
    assert find_subsequence([1, 2, 1, 2], [1, 2]) == 0
    assert rfind_subsequence([1, 2, 1, 2], [1, 2]) == 2
    assert find_subsequence([1, 2], [2, 3]) == -1
    assert rfind_subsequence([], [1]) == -1


def test_padding_sides():
    assert pad_tokens([1, 2], 4, 0, "left") == [0, 0, 1, 2]
    assert pad_tokens([1, 2], 4, 0, "right") == [1, 2, 0, 0]
    with pytest.raises(ValueError):
        pad_tokens([1, 2, 3], 2, 0)


def test_split_is_seeded_and_disjoint():
    train, test = split_indices(20, 0.25, seed=3)
    assert sorted(train + test) == list(range(20)) and len(test) == 5
    assert split_indices(20, 0.25, seed=3) == (train, test)
    assert split_indices(20, 0.25, seed=4) != (train, test)
    assert all(len(part) == 1 for part in split_indices(2, 0.01, 0))


def test_a_query_that_breaks_the_data_contract_is_dropped_and_counted(tiny_tokenizer):
    """A control character or a bidirectional override inside the kept window would make every
    preference row on that query fail validate_preferences (exit 3); one after the end text is cut
    away with the rest of the passage and harms nothing."""
    passages = [
        "A. Bell \x07 rang.",  # BEL inside the query
        "A. Read \u202e it.",  # a right-to-left override inside the query
        "A. Clean one.",
        "A. Clean two. \x07 tail",  # BEL after the window's last '.': cut away with the tail
        "A. Clean three.",
    ]
    splits, counts = build_queries(passages, tiny_tokenizer, 24, ".", ".", 0.5, seed=0)
    assert counts[f"dropped_{BAD_TEXT}"] == 2 and counts["kept"] == 3 == counts["train"] + counts["test"]
    texts = splits["train"]["query"] + splits["test"]["query"]
    assert sorted(texts) == [" Clean one.", " Clean three.", " Clean two."]
    prefix, pad = special_prefix(tiny_tokenizer), tiny_tokenizer.pad_token_id
    for split in splits.values():  # each text is still its own ids, decoded
        for ids, text in zip(split["query_ids"], split["query"]):
            assert tiny_tokenizer.decode(without_prefix([t for t in ids if t != pad], prefix)) == text


CORPUS = [
    "Intro words. The movie was wonderful. I loved it. Trailing words without an end",
    "No period in this one at all",
    "Ends with the start token.",
    "One. Two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen. Seventeen.",
    "She walked to the market. He bought bread. They went home.",
    "Zero. The sky is blue. Birds sing.",
]


@pytest.mark.e2e
def test_queries_stage(project, tiny_tokenizer):
    corpus_file = project / "data" / "raw" / "corpus.txt"
    corpus_file.parent.mkdir(parents=True, exist_ok=True)
    corpus_file.write_text("\n".join(CORPUS) + "\n")
    project.write_params(**{"data.corpus.source": "data/raw/corpus.txt", "data.queries.test_fraction": 0.34})
    assert run_stage_script("corpus") == 0
    assert run_stage_script("queries") == 0

    from datasets import load_from_disk

    from rlhf_pipeline.io import read_json

    metrics = read_json(project / "metrics" / "queries.json")
    assert metrics["passages"] == 6
    assert metrics["dropped_no_start"] == 1 and metrics["dropped_nothing_after_start"] == 1
    assert metrics["kept"] + sum(v for k, v in metrics.items() if k.startswith("dropped_")) == 6
    assert metrics["train"] + metrics["test"] == metrics["kept"] >= 3 and metrics["test"] >= 1
    queries = load_from_disk(str(project / "data" / "queries"))
    pad = tiny_tokenizer.pad_token_id
    for split in ("train", "test"):
        for ids, text in zip(queries[split]["query_ids"], queries[split]["query"]):
            assert len(ids) == 16
            real = [t for t in ids if t != pad]
            assert ids[: 16 - len(real)] == [pad] * (16 - len(real))  # left padded
            assert tiny_tokenizer.decode(real) == text
            assert text.endswith(".")
    assert any(
        q.strip() == "The movie was wonderful."
        for q in list(queries["train"]["query"]) + list(queries["test"]["query"])
    )


@pytest.mark.e2e
def test_too_few_held_out_queries_stop_the_queries_stage(project, capsys):
    """6 passages leave 2 held-out queries: below data.queries.min_test_queries (3) the stage stops
    with exit 2 (a noisy evaluation at the end is no answer) and writes nothing."""
    corpus_file = project / "data" / "raw" / "corpus.txt"
    corpus_file.parent.mkdir(parents=True, exist_ok=True)
    corpus_file.write_text("\n".join(CORPUS) + "\n")
    project.write_params(
        **{
            "data.corpus.source": "data/raw/corpus.txt",
            "data.queries.test_fraction": 0.34,
            "data.queries.min_test_queries": 3,
        }
    )
    assert run_stage_script("corpus") == 0
    assert run_stage_script("queries") == 2
    err = capsys.readouterr().err
    assert "data.queries.min_test_queries: 3, but only 1 held-out queries" in err and "Traceback" not in err
    assert not (project / "data" / "queries").exists()


@pytest.mark.e2e
def test_queries_stage_refuses_when_nothing_survives(project, capsys):
    (project / "data" / "raw").mkdir(parents=True, exist_ok=True)
    (project / "data" / "raw" / "corpus.txt").write_text("no periods here\nnor here\n")
    project.write_params(**{"data.corpus.source": "data/raw/corpus.txt"})
    assert run_stage_script("corpus") == 0
    assert run_stage_script("queries") == 1
    assert "data.queries.start_text" in capsys.readouterr().err


@pytest.mark.e2e
def test_a_corpus_file_outside_data_raw_is_refused(project, tmp_path, capsys):
    """DVC tracks data/raw/ for the corpus stage: a file elsewhere would be read but never seen change."""
    outside = tmp_path.parent / f"{tmp_path.name}-corpus.txt"
    outside.write_text("\n".join(CORPUS) + "\n")
    project.write_params(**{"data.corpus.source": str(outside)})
    assert run_stage_script("corpus") == 2
    err = capsys.readouterr().err
    assert "data.corpus.source: the file" in err and "outside data/raw/" in err and "Copy it into data/raw/" in err
    assert not (project / "data" / "corpus").exists()
