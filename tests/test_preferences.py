"""Preference labels: best picking, ceiling accuracy, simulation on the tiny model, converters, stage."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import run_stage_script

from rlhf_pipeline.candidates import sample_problem
from rlhf_pipeline.errors import PipelineError
from rlhf_pipeline.labelers import Labeler, get_labeler
from rlhf_pipeline.params.task import TaskParams
from rlhf_pipeline.preferences.formats import (
    BEST_OF_N,
    PAIRWISE,
    best_of_n_to_internal,
    detect_format,
    pairwise_to_internal,
    to_flat_frame,
)
from rlhf_pipeline.preferences.simulated import ceiling_accuracy, pick_best, simulate_preferences
from rlhf_pipeline.preferences.splits import load_user_frames
from rlhf_pipeline.queries import is_left_padded, pad_tokens
from rlhf_pipeline.sampling import ResponseSampler
from rlhf_pipeline.sources import TINY_TEXT
from rlhf_pipeline.text_rules import BAD_CHARACTER_CHECK, EMPTY_TEXT_CHECK, text_problem


class CountE(Labeler):
    """A fake labeler: more letters 'e' is better (ties broken by length)."""

    name = "count_e"

    def score(self, texts):
        return [t.count("e") + 0.001 * len(t) for t in texts]


SENTENCES = [s.strip() + "." for text in TINY_TEXT for s in text.split(".") if s.strip() and len(s) < 40]


def tiny_queries(tokenizer, n: int, length: int = 16):
    rows = [
        tokenizer.encode(
            " " + SENTENCES[i % len(SENTENCES)] + " " + SENTENCES[(i * 7 + 3) % len(SENTENCES)],
            add_special_tokens=False,
        )[:length]
        for i in range(n)
    ]
    return [pad_tokens(r, length, tokenizer.pad_token_id, "left") for r in rows], [tokenizer.decode(r) for r in rows]


# --------------------------------------------------------------------------------------------
# picking and ceiling
# --------------------------------------------------------------------------------------------
def test_label_temperature_zero_is_argmax():
    scores = np.array([[0.1, 0.9, 0.3], [-2.0, -1.0, -3.0], [0.0, 0.2, 0.2]])
    assert pick_best(scores, 0.0, np.random.default_rng(0)).tolist()[:2] == [1, 1]
    tied = np.tile(np.array([[0.5, -1.0, 0.5, 0.5]]), (300, 1))  # ties broken at random among maxima
    picks = pick_best(tied, 0.0, np.random.default_rng(0))
    assert set(picks.tolist()) == {0, 2, 3}
    assert picks.tolist() == pick_best(tied, 0.0, np.random.default_rng(0)).tolist()


def test_label_temperature_samples_softmax():
    scores = np.tile(np.array([[0.0, np.log(3.0)]]), (4000, 1))  # p = (0.25, 0.75) at T=1
    picks = pick_best(scores, 1.0, np.random.default_rng(0))
    assert abs(picks.mean() - 0.75) < 0.03
    cold = pick_best(scores, 0.01, np.random.default_rng(0))
    assert cold.tolist() == [1] * 4000
    assert (
        pick_best(scores[:50], 1.0, np.random.default_rng(7)).tolist()
        == pick_best(scores[:50], 1.0, np.random.default_rng(7)).tolist()
    )


def test_ceiling_accuracy_by_hand():
    gold = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.4], [0.0, -1.0]])
    assert ceiling_accuracy(gold, np.array([1, 0, 0, 1])) == 0.5
    assert ceiling_accuracy(gold, gold.argmax(1)) == 1.0


def test_sample_problem():
    assert sample_problem(["a", "b"]) is None
    assert sample_problem(["a", " \n"]) == "empty_sample"
    assert sample_problem(["a", "a"]) == "duplicate_samples"
    assert sample_problem(["a", "b\x07"]) == "bad_characters"
    assert sample_problem(["a\tb\nc", "b"]) is None
    assert sample_problem(["a", "\u200b\u200b"]) == "empty_sample"  # invisible only: the contract's empty text
    assert sample_problem(["a", "b \u202eb"]) == "bad_characters"


@pytest.mark.parametrize(
    "text, check",
    [("\u200b\u200b", EMPTY_TEXT_CHECK), ("pay \u202eelbuod\u202c now", BAD_CHARACTER_CHECK), ("fine.", None)],
)
def test_one_text_rule_for_the_labeller_the_stage_and_the_contract(tmp_path, capsys, text, check):
    """text_problem (the labeller's and the stage's pre-check) and the contract's report agree."""
    from rlhf_pipeline.contract import validate_file_cli

    assert text_problem(text) == check
    rows = [{"prompt": f"Prompt {i}.", "chosen": f"Good {i}.", "rejected": f"Bad {i}."} for i in range(200)]
    rows[5]["chosen"] = text
    path = tmp_path / "pairs.jsonl"
    pd.DataFrame(rows).to_json(path, orient="records", lines=True)
    code = validate_file_cli(str(path))
    out = capsys.readouterr().out
    assert code == (0 if check is None else 3), out
    assert (check is None) or f"{check} [column chosen]: 1 row(s)" in out


def test_vader_labeler_prefers_positive_text():
    labeler = get_labeler("vader")
    good, bad = labeler.score(["What a wonderful, happy day!", "This is awful and sad."])
    assert good > 0 > bad
    with pytest.raises(PipelineError, match="unknown labeler"):
        get_labeler("nope")


def test_is_left_padded():
    assert is_left_padded(torch.tensor([[0, 0, 5, 6], [0, 7, 8, 9], [0, 0, 0, 0], [1, 2, 3, 4]]), 0)
    assert not is_left_padded(torch.tensor([[0, 0, 5, 6], [5, 6, 0, 0]]), 0)
    assert not is_left_padded(torch.tensor([[0, 5, 0, 6]]), 0)


# --------------------------------------------------------------------------------------------
# simulation on the tiny model
# --------------------------------------------------------------------------------------------
def simulate(model, tokenizer, seed=0, num_rows=6, temperature=0.0, n=4):
    task = TaskParams(response_length=8, truncate_after=4, temperature=0.7)
    sampler = ResponseSampler.from_tokenizer(task, tokenizer)
    query_ids, queries = tiny_queries(tokenizer, 12)
    return simulate_preferences(
        model,
        tokenizer,
        sampler,
        query_ids,
        queries,
        num_rows,
        n,
        CountE(),
        temperature,
        4,
        torch.Generator().manual_seed(seed),
        np.random.default_rng(seed),
    )


def test_simulated_shapes_and_labels(tiny_model, tiny_tokenizer):
    result = simulate(tiny_model, tiny_tokenizer)
    cols, pad = result.columns, tiny_tokenizer.pad_token_id
    assert len(cols["best"]) == 6 and result.queries_used >= 6
    assert all(len(q) == 16 for q in cols["query_ids"])
    for samples, ids, gold, best in zip(cols["samples"], cols["sample_ids"], cols["gold"], cols["best"]):
        assert len(samples) == 4 and len(ids) == 4 and all(len(r) == 8 for r in ids)
        assert 0 <= best < 4 and gold[best] == max(gold)  # temperature 0 = argmax
        assert gold == pytest.approx(CountE().score(samples))
        for text, row in zip(samples, ids):
            assert tiny_tokenizer.decode([t for t in row if t != pad], skip_special_tokens=True) == text
            # OAI truncation: after the first '.' at index >= truncate_after only padding
            dot = tiny_tokenizer.encode(".", add_special_tokens=False)[0]
            stops = [j for j, t in enumerate(row) if t == dot and j >= 4]
            if stops:
                assert all(t == pad for t in row[stops[0] + 1 :])
    untied = [g.count(max(g)) == 1 for g in cols["gold"]]
    expected = np.mean([b == int(np.argmax(g)) for g, b in zip(cols["gold"], cols["best"])])
    assert ceiling_accuracy(np.array(cols["gold"]), np.array(cols["best"])) == expected
    assert all(b == int(np.argmax(g)) for g, b, u in zip(cols["gold"], cols["best"], untied) if u)
    assert cols["margin"] == [0.0] * 6


def test_simulation_is_deterministic_and_seeded(tiny_model, tiny_tokenizer):
    first = simulate(tiny_model, tiny_tokenizer, seed=3, temperature=1.0).columns
    assert simulate(tiny_model, tiny_tokenizer, seed=3, temperature=1.0).columns == first
    assert simulate(tiny_model, tiny_tokenizer, seed=4, temperature=1.0).columns["samples"] != first["samples"]


def test_simulation_labels_queries_again_on_fresh_samples(tiny_model, tiny_tokenizer):
    """30 rows from 12 queries: the query list starts over, each query is labelled 2-3 times, on new samples."""
    cols = simulate(tiny_model, tiny_tokenizer, num_rows=30).columns
    assert len(cols["best"]) == 30
    counts = {q: cols["query"].count(q) for q in set(cols["query"])}
    assert len(counts) == 12 and set(counts.values()) <= {2, 3}
    first_query = cols["query"][0]
    repeats = [samples for q, samples in zip(cols["query"], cols["samples"]) if q == first_query]
    assert repeats[0] != repeats[1]


def test_simulation_refuses_when_no_row_passes_the_contract(tiny_model, tiny_tokenizer):
    """Near-greedy one-token responses are four identical samples: every row breaks the contract."""
    sampler = ResponseSampler.from_tokenizer(
        TaskParams(response_length=1, truncate_token=None, temperature=0.001), tiny_tokenizer
    )
    query_ids, queries = tiny_queries(tiny_tokenizer, 12)
    with pytest.raises(PipelineError, match="num_labels.*duplicate_samples"):
        simulate_preferences(
            tiny_model,
            tiny_tokenizer,
            sampler,
            query_ids,
            queries,
            6,
            4,
            CountE(),
            0.0,
            4,
            torch.Generator().manual_seed(0),
            np.random.default_rng(0),
        )


# --------------------------------------------------------------------------------------------
# user formats
# --------------------------------------------------------------------------------------------
PAIRS = pd.DataFrame(
    {
        "prompt": ["The movie was", "She walked to the market and then"],
        "chosen": ["great fun.", "bought bread."],
        "rejected": ["bad.", "the weather is fine and the sky is blue and"],
        "margin": [1.5, None],
    }
)


def test_pairwise_to_internal(tiny_tokenizer):
    tok, pad = tiny_tokenizer, tiny_tokenizer.pad_token_id
    cols = pairwise_to_internal(PAIRS, tok, query_length=5, response_length=6)
    assert cols["samples"] == [["great fun.", "bad."], ["bought bread.", "the weather is fine and the sky is blue and"]]
    assert cols["best"] == [0, 0] and cols["gold"] == [None, None] and cols["margin"] == [1.5, 0.0]
    long_prompt = tok.encode("She walked to the market and then", add_special_tokens=False)
    assert cols["query_ids"][1] == long_prompt[-5:]  # the LAST query_length tokens
    short = tok.encode("The movie was", add_special_tokens=False)
    assert cols["query_ids"][0] == [pad] * (5 - len(short)) + short if len(short) < 5 else short[-5:]
    rejected = tok.encode("the weather is fine and the sky is blue and", add_special_tokens=False)
    assert cols["sample_ids"][1][1] == rejected[:6]  # the FIRST response_length tokens
    chosen = tok.encode("great fun.", add_special_tokens=False)[:6]
    assert cols["sample_ids"][0][0] == chosen + [pad] * (6 - len(chosen))  # right padded
    long = pairwise_to_internal(PAIRS, tok, query_length=40, response_length=6)
    assert long["query_ids"][0] == [pad] * (40 - len(short)) + short  # left padded, like data/queries


def test_best_of_n_to_internal(tiny_tokenizer):
    frame = pd.DataFrame(
        {
            "query": ["q one", "q two"],
            "sample0": ["a", "b"],
            "sample2": ["e", "f"],
            "sample1": ["c", "d"],
            "best": [2, 0],
        }
    )
    cols = best_of_n_to_internal(frame, tiny_tokenizer, 4, 3)
    assert cols["samples"] == [["a", "c", "e"], ["b", "d", "f"]] and cols["best"] == [2, 0]
    assert all(len(r) == 3 and all(len(x) == 3 for x in r) for r in cols["sample_ids"])
    with pytest.raises(PipelineError, match="best"):
        best_of_n_to_internal(frame.assign(best=[3, 0]), tiny_tokenizer, 4, 3)
    with pytest.raises(PipelineError, match="null"):
        best_of_n_to_internal(frame.assign(sample1=["c", None]), tiny_tokenizer, 4, 3)


def test_detect_format_and_flat_frame():
    assert detect_format(PAIRS, "f") == PAIRWISE
    assert detect_format(pd.DataFrame(columns=["query", "sample0", "sample1", "best"]), "f") == BEST_OF_N
    with pytest.raises(PipelineError, match=r"\['text', 'label'\]"):
        detect_format(pd.DataFrame(columns=["text", "label"]), "f")
    flat = to_flat_frame(PAIRS, PAIRWISE)
    assert list(flat.columns) == ["query", "sample0", "sample1", "best", "margin"] and flat["best"].tolist() == [0, 0]


def test_user_split_column_and_seeded_split(tmp_path):
    rows = [
        {"prompt": f"p{i}", "chosen": f"c{i}", "rejected": f"r{i}", "split": "test" if i % 4 == 0 else "train"}
        for i in range(8)
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    frames, fmt = load_user_frames(str(path), "train", 0.5, seed=0)
    assert fmt == PAIRWISE and len(frames["train"]) == 6 and frames["test"]["prompt"].tolist() == ["p0", "p4"]
    path.write_text("\n".join(json.dumps({k: v for k, v in r.items() if k != "split"}) for r in rows))
    frames, _ = load_user_frames(str(path), "train", 0.25, seed=0)
    assert (len(frames["train"]), len(frames["test"])) == (6, 2)
    assert load_user_frames(str(path), "train", 0.25, seed=0)[0]["test"].equals(frames["test"])


# --------------------------------------------------------------------------------------------
# the stage
# --------------------------------------------------------------------------------------------
def write_corpus(project, n=40):
    lines = [f"Start. {SENTENCES[i % len(SENTENCES)]} {SENTENCES[(3 * i + 1) % len(SENTENCES)]}" for i in range(n)]
    (project / "data" / "raw").mkdir(parents=True, exist_ok=True)
    (project / "data" / "raw" / "corpus.txt").write_text("\n".join(lines) + "\n")


@pytest.mark.e2e
def test_preferences_stage_simulated(project):
    from datasets import load_from_disk

    from rlhf_pipeline.io import read_json

    write_corpus(project)
    project.write_params(**{"data.corpus.source": "data/raw/corpus.txt"})
    assert run_stage_script("corpus") == 0 and run_stage_script("queries") == 0
    assert run_stage_script("preferences") == 0
    prefs = load_from_disk(str(project / "data" / "preferences"))
    assert (len(prefs["train"]), len(prefs["test"])) == (8, 4)
    assert set(prefs["train"].column_names) == {"query", "query_ids", "samples", "sample_ids", "best", "gold", "margin"}
    metrics = read_json(project / "metrics" / "preferences.json")
    both = [prefs[split][:] for split in ("train", "test")]
    gold, best = np.array([g for b in both for g in b["gold"]]), np.array([x for b in both for x in b["best"]])
    assert metrics["labels/ceiling_accuracy"] == pytest.approx(ceiling_accuracy(gold, best))
    assert metrics["rows/train"] == 8 and metrics["rows/test"] == 4
    assert sum(metrics[f"labels/best_share/train/{i}"] for i in range(4)) == pytest.approx(1.0)
    assert -1.0 <= metrics["labels/mean_gold"] <= 1.0
    first = prefs["train"][:]
    assert run_stage_script("preferences") == 0  # same seed, same labels
    assert load_from_disk(str(project / "data" / "preferences"))["train"][:] == first


@pytest.mark.e2e
def test_preferences_stage_user_pairwise(project):
    from datasets import load_from_disk

    rows = [
        {"prompt": f"Prompt number {i}.", "chosen": f"A good answer {i}.", "rejected": f"A bad answer {i}."}
        for i in range(10)
    ]
    (project / "data" / "labels").mkdir(parents=True)
    pd.DataFrame(rows).to_parquet(project / "data" / "labels" / "pairs.parquet")
    project.write_params(**{"data.preferences.source": "data/labels/pairs.parquet"})
    assert run_stage_script("preferences") == 0
    prefs = load_from_disk(str(project / "data" / "preferences"))
    assert len(prefs["train"]) + len(prefs["test"]) == 10 and len(prefs["test"]) >= 1
    row = prefs["train"][0]
    assert row["best"] == 0 and row["gold"] is None and len(row["samples"]) == 2 and len(row["query_ids"]) == 16
    assert json.loads((project / "data" / "preferences" / "format.json").read_text())["format"] == PAIRWISE


@pytest.mark.e2e
def test_an_overlong_user_text_is_refused_before_tokenization(project, capsys, monkeypatch):
    """A 5 MB row: the stage refuses it by length (exit 3) without handing it to the tokenizer."""
    rows = [
        {"prompt": f"Prompt number {i}.", "chosen": f"A good answer {i}.", "rejected": f"A bad answer {i}."}
        for i in range(10)
    ]
    rows[4]["rejected"] = "x" * 5_000_000
    (project / "data" / "labels").mkdir(parents=True)
    pd.DataFrame(rows).to_parquet(project / "data" / "labels" / "pairs.parquet")
    project.write_params(**{"data.preferences.source": "data/labels/pairs.parquet", "data.queries.test_fraction": 0.1})
    assert run_stage_script("preferences") == 3
    err = capsys.readouterr().err
    assert (
        "column 'rejected', row " in err
        and "a text of 5000000 characters, over data.validation.max_text_chars (4000)" in err
    )
    assert not (project / "data" / "preferences").exists()


def run_on_pairs(project, edit) -> int:
    """The preferences stage on a user's file of ten pairs (and a round), after ``edit(rows)``."""
    rows = [
        {"prompt": f"Prompt number {i}.", "chosen": f"A good answer {i}.", "rejected": f"A bad answer {i}.", "round": 1}
        for i in range(10)
    ]
    edit(rows)
    (project / "data" / "labels").mkdir(parents=True)
    pd.DataFrame(rows).to_json(project / "data" / "labels" / "pairs.jsonl", orient="records", lines=True)
    project.write_params(**{"data.preferences.source": "data/labels/pairs.jsonl", "data.queries.test_fraction": 0.1})
    return run_stage_script("preferences")


@pytest.mark.e2e
def test_the_stage_refuses_a_text_the_contract_refuses(project, capsys):
    """A bidirectional override inside a reply: the preferences stage refuses the file as
    `rlhf validate-preferences` does (exit 3, column and row named), and writes nothing."""
    assert run_on_pairs(project, lambda rows: rows[4].update(rejected="pay \u202eelbuod\u202c now")) == 3
    err = capsys.readouterr().err
    assert "column 'rejected', row " in err and BAD_CHARACTER_CHECK in err and "Traceback" not in err
    assert not (project / "data" / "preferences").exists()


@pytest.mark.e2e
def test_replies_that_differ_only_after_the_cut_are_refused_with_the_file_rows(project, capsys):
    """task.response_length is 8 tokens here: a pair that differs only after them would train as two
    identical replies, so the stage refuses the file (exit 3), naming the file's rows, and writes nothing."""
    same_start = "Well, the film we saw together last night was, all things considered,"
    rows = [
        {"prompt": f"Prompt number {i}.", "chosen": f"A good answer {i}.", "rejected": f"A bad answer {i}."}
        for i in range(10)
    ]
    rows[6] = {"prompt": "How was it?", "chosen": same_start + " wonderful.", "rejected": same_start + " dreadful."}
    (project / "data" / "labels").mkdir(parents=True)
    pd.DataFrame(rows).to_json(project / "data" / "labels" / "pairs.jsonl", orient="records", lines=True)
    project.write_params(**{"data.preferences.source": "data/labels/pairs.jsonl", "data.queries.test_fraction": 0.1})
    assert run_stage_script("preferences") == 3
    err = capsys.readouterr().err
    assert "differ only after their first 8 tokens (task.response_length)" in err and "rows [6]" in err
    assert not (project / "data" / "preferences").exists()


@pytest.mark.e2e
def test_cut_prompts_and_replies_are_counted_and_reported(project, capsys):
    """Prompts longer than query_length keep their end, replies longer than response_length their
    start: the stage counts both (metrics, format.json) and the validation report repeats them."""
    rows = [{"prompt": f"Prompt number {i}.", "chosen": f"Yes {i}.", "rejected": f"No {i}."} for i in range(10)]
    rows[2]["prompt"] = "Tell me, in as many words as you like, what you thought of the film we saw. " * 3
    rows[3]["chosen"] = "It was a wonderful film with a kind story, fine acting and a happy ending for all."
    (project / "data" / "labels").mkdir(parents=True)
    pd.DataFrame(rows).to_json(project / "data" / "labels" / "pairs.jsonl", orient="records", lines=True)
    project.write_params(**{"data.preferences.source": "data/labels/pairs.jsonl", "data.queries.test_fraction": 0.1})
    assert run_stage_script("preferences") == 0
    metrics = json.loads((project / "metrics" / "preferences.json").read_text())
    info = json.loads((project / "data" / "preferences" / "format.json").read_text())["truncated"]
    assert sum(metrics[f"truncated_prompts/{s}"] for s in ("train", "test")) == 1
    assert sum(metrics[f"truncated_responses/{s}"] for s in ("train", "test")) == 1
    assert {s: info[s] for s in info} == {
        s: {w: metrics[f"{w}/{s}"] for w in ("truncated_prompts", "truncated_responses")} for s in ("train", "test")
    }
    assert "keep only their last tokens" in capsys.readouterr().out
    assert run_stage_script("validate_preferences") == 0
    summary = json.loads((project / "data" / "validation" / "summary.json").read_text())
    assert summary["truncated"] == info


def test_human_labels_are_held_out_by_task_and_their_rounds_summarised():
    """Two annotators of one task never land on both sides of the split; a row without a task id is a
    task of its own; label_rounds counts rows, tasks, annotators and the sampling models per round."""
    import pandas as pd

    from rlhf_pipeline.preferences.splits import label_rounds, split_positions

    tasks = [f"t{i // 2}" for i in range(40)] + [None, None]  # 20 tasks of 2 annotations, 2 rows without
    frame = pd.DataFrame(
        {
            "task_id": tasks,
            "annotator": ["a", "b"] * 21,
            "round": [1] * 20 + [2] * 20 + [None, None],
            "model": ["base"] * 20 + ["policy@v1.0.0"] * 20 + [None, None],
        }
    )
    rows = split_positions(frame, "labels.jsonl", 0.25, seed=3)
    assert sorted(rows["train"] + rows["test"]) == list(range(42))
    test_tasks = {frame["task_id"][i] for i in rows["test"] if frame["task_id"][i] is not None}
    train_tasks = {frame["task_id"][i] for i in rows["train"] if frame["task_id"][i] is not None}
    assert test_tasks and not test_tasks & train_tasks
    assert len(rows["test"]) in (10, 11, 12)  # round(22 tasks * 0.25) = 6 tasks: whole pairs, at most one lone row
    rounds = label_rounds(frame, "labels.jsonl")
    assert rounds == [
        {"round": None, "rows": 2, "tasks": 0, "annotators": 2, "model": []},
        {"round": 1, "rows": 20, "tasks": 10, "annotators": 2, "model": ["base"]},
        {"round": 2, "rows": 20, "tasks": 10, "annotators": 2, "model": ["policy@v1.0.0"]},
    ]
    assert label_rounds(frame.drop(columns="round"), "labels.jsonl") is None


@pytest.mark.e2e
def test_a_round_column_holding_text_is_refused_by_the_stage(project, capsys):
    """A hand-edited label file whose `round` holds text: exit 3 naming the file, the column and the
    value (it used to be a traceback inside label_rounds), nothing written."""
    assert run_on_pairs(project, lambda rows: rows[3].update(round="two")) == 3
    err = capsys.readouterr().err
    assert "data/labels/pairs.jsonl: the round column holds 'two'" in err and "Traceback" not in err
    assert not (project / "data" / "preferences").exists()
