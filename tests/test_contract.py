"""The Great Expectations contract: clean files pass, each planted defect is refused by name."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest
import yaml
from conftest import run_stage_script

from rlhf_pipeline.contract import format_summary, validate_dataframe, validate_file_cli
from rlhf_pipeline.errors import DataContractError
from rlhf_pipeline.params.data import ValidationParams
from rlhf_pipeline.preferences.formats import BEST_OF_N, PAIRWISE, display_names, to_flat_frame

ROWS = 80


def pairwise_rows(n=ROWS):
    return [
        {
            "prompt": f"Prompt number {i}.",
            "chosen": f"A kind and helpful answer {i}.",
            "rejected": f"A rude answer {i}.",
        }
        for i in range(n)
    ]


def best_of_n_rows(n=ROWS):
    return [
        {"query": f"Query {i}:", **{f"sample{k}": f"Sample {k} for query {i}." for k in range(4)}, "best": i % 4}
        for i in range(n)
    ]


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def check(tmp_path, capsys, rows, name="prefs.jsonl", params=None, **kwargs):
    """Run validate_file_cli on ``rows``; returns (exit code, printed output)."""
    path = tmp_path / name
    if name.endswith(".parquet"):
        pd.DataFrame(rows).to_parquet(path)
    else:
        write_jsonl(path, rows)
    params_path = tmp_path / "params.yaml"
    if params:
        params_path.write_text(yaml.safe_dump({"data": {"validation": params}}))
    code = validate_file_cli(str(path), params_path=str(params_path), **kwargs)
    return code, capsys.readouterr().out


@pytest.mark.parametrize("fmt", ["pairwise", "best_of_n"])
@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_clean_file_passes(tmp_path, capsys, fmt, suffix):
    rows = pairwise_rows() if fmt == "pairwise" else best_of_n_rows()
    result = tmp_path / "gx.json"
    code, out = check(tmp_path, capsys, rows, name=f"prefs.{suffix}", result_path=str(result))
    assert code == 0, out
    assert out.strip().endswith("expectations") and f"ok: {ROWS} rows passed" in out
    assert json.loads(result.read_text())["success"] is True


def with_margin(rows, margin=1.0):
    return [dict(r, margin=margin) for r in rows]


def with_row(rows, index, **changes):
    rows = [dict(r) for r in rows]
    rows[index].update(changes)
    return rows


DEFECTS = {
    "null": (with_row(pairwise_rows(), 3, chosen=None), "no nulls [column chosen]: 1 row(s)"),
    "empty": (
        with_row(pairwise_rows(), 4, rejected="  \n "),
        "no empty, whitespace-only or invisible-only text [column rejected]: 1 row(s)",
    ),
    "zero-width only": (
        with_row(pairwise_rows(), 4, chosen="\u200b\u2060\ufeff"),
        "no empty, whitespace-only or invisible-only text [column chosen]: 1 row(s)",
    ),
    "huge margin": (
        with_row(with_margin(best_of_n_rows()), 5, margin=1e300),
        "|margin| <= max_abs_margin (100), finite [column margin]: 1 row(s)",
    ),
    "control character": (
        with_row(pairwise_rows(), 5, chosen="bell \x07 here"),
        "no invalid UTF-8, control or bidirectional-override characters [column chosen]",
    ),
    "lone surrogate": (
        with_row(pairwise_rows(), 6, prompt="bad \ud800 escape"),
        "no invalid UTF-8, control or bidirectional-override characters [column prompt]",
    ),
    "chosen == rejected": (
        with_row(pairwise_rows(), 7, rejected="A kind and helpful answer 7."),
        "distinct samples in a row (chosen != rejected) [column chosen, rejected]: 1 row(s)",
    ),
    "duplicate samples": (
        with_row(best_of_n_rows(), 8, sample3="Sample 1 for query 8."),
        "distinct samples in a row (chosen != rejected) [column sample0, sample1, sample2, sample3]",
    ),
    "best out of range": (with_row(best_of_n_rows(), 9, best=4), "best within [0, 4) [column best]: 1 row(s)"),
    "negative best": (with_row(best_of_n_rows(), 9, best=-1), "best within [0, 4)"),
    "duplicate rows": (
        pairwise_rows() + pairwise_rows()[:2],
        "no duplicate rows [column prompt, chosen, rejected]: 4 row(s)",
    ),
    "too long": (
        with_row(pairwise_rows(), 10, chosen="x" * 4001),
        "text length <= max_text_chars (4000) [column chosen]: 1 row(s)",
    ),
    "too few rows": (pairwise_rows(10), "row count >= min_rows (64) [column (table)]: observed 10"),
    "degenerate labels": (
        [dict(r, best=0 if i else 1) for i, r in enumerate(best_of_n_rows())],
        "labels not degenerate (most common best share <= max_label_share 0.95)",
    ),
    "missing column": (
        [{k: v for k, v in r.items() if k != "rejected"} for r in pairwise_rows()],
        "missing column [column rejected]: observed not found; the columns are prompt, chosen",
    ),
    "missing best": (
        [{k: v for k, v in r.items() if k != "best"} for r in best_of_n_rows()],
        "missing column [column best]",
    ),
    "wrong type": (with_row(best_of_n_rows(), 2, sample0=17), "text type (string) [column sample0]: 1 row(s)"),
}


@pytest.mark.parametrize("defect", list(DEFECTS))
def test_each_defect_is_refused_by_name(tmp_path, capsys, defect):
    rows, expected = DEFECTS[defect]
    code, out = check(tmp_path, capsys, rows)
    assert code == 3
    assert "FAILED" in out and expected in out, out


def test_invalid_utf8_bytes_in_file(tmp_path, capsys):
    path = write_jsonl(tmp_path / "prefs.jsonl", pairwise_rows())
    raw = path.read_bytes().replace(b"A rude answer 11.", b"A rude \xff\xfe answer 11.")
    path.write_bytes(raw)
    assert validate_file_cli(str(path), params_path=str(tmp_path / "none.yaml")) == 3
    out = capsys.readouterr().out
    assert "no invalid UTF-8, control or bidirectional-override characters [column rejected]: 1 row(s)" in out
    assert "row 11:" in out and "\\ufffd" in out  # the example row, escaped


def test_token_length_needs_a_tokenizer(tmp_path, capsys, tiny_base_dir):
    rows = with_row(pairwise_rows(), 12, chosen="word " * 60)
    code, out = check(tmp_path, capsys, rows, params={"max_tokens": 40}, tokenizer_dir=str(tiny_base_dir))
    assert code == 3 and "token length <= max_tokens (40) [column (table)]: 1 row(s)" in out and "row 12:" in out
    code, out = check(tmp_path, capsys, rows, params={"max_tokens": 40}, tokenizer_dir=str(tmp_path / "no-model"))
    assert code == 0 and "note: token lengths not checked" not in out  # ok line only


def test_summary_lists_at_most_three_examples():
    rows = pairwise_rows()
    for i in range(5):
        rows[i]["chosen"] = rows[i]["rejected"]
    flat = to_flat_frame(pd.DataFrame(rows), PAIRWISE)
    result = validate_dataframe(flat, ValidationParams(), label_check=False, names=display_names(PAIRWISE))
    assert not result.success and result.rows == ROWS
    [failure] = result.failures
    assert failure["count"] == 5 and len(failure["examples"]) == 3
    assert failure["examples"][0] == {
        "row": 0,
        "prompt": "Prompt number 0.",
        "chosen": "A rude answer 0.",
        "rejected": "A rude answer 0.",
    }
    text = format_summary(result)
    assert text.count("    row ") == 3 and "5 row(s)" in text
    assert result.gx_json["success"] is False and len(result.gx_json["results"]) == result.expectations


@pytest.mark.e2e
def test_validate_preferences_stage(project, capsys):
    from rlhf_pipeline.io import read_json

    (project / "data" / "labels").mkdir(parents=True)
    write_jsonl(project / "data" / "labels" / "pairs.jsonl", pairwise_rows(40))
    project.write_params(**{"data.preferences.source": "data/labels/pairs.jsonl", "data.validation.min_rows": 20})
    assert run_stage_script("preferences") == 0
    assert run_stage_script("validate_preferences") == 0
    summary = read_json(project / "data" / "validation" / "summary.json")
    assert summary["success"] is True and summary["rows"] == 40 and summary["failures"] == []
    assert set(read_json(project / "data" / "validation" / "result.json")) == {"train", "test"}
    captured = capsys.readouterr()
    assert "ok:" in captured.out
    # GX renders every observed value (pandas gives numpy floats, which its formatter chokes on)
    assert "Traceback" not in captured.out + captured.err and "num_to_str" not in captured.out + captured.err
    page = (project / "data" / "validation_docs" / "train.html").read_text()
    assert "<h1>data/preferences: preference-data contract, split train</h1>" in page

    rows = pairwise_rows(40)
    rows[1]["rejected"] = rows[1]["chosen"]
    write_jsonl(project / "data" / "labels" / "pairs.jsonl", rows)
    assert run_stage_script("preferences") == 0
    before = sorted(p.name for p in (project / "data").iterdir())
    assert run_stage_script("validate_preferences") == 3
    err = capsys.readouterr().err
    assert "distinct samples in a row (chosen != rejected)" in err
    summary = read_json(project / "data" / "validation" / "summary.json")
    assert summary["success"] is False and summary["failures"][0]["check"].startswith("distinct samples")
    assert sorted(p.name for p in (project / "data").iterdir()) == before
    docs = (project / "data" / "validation_docs" / "index.html").read_text()
    assert '<a href="train.html">train</a></td><td class="status-danger">FAILED' in docs
    page = (project / "data" / "validation_docs" / "train.html").read_text()
    assert "unique across columns" in page and '<span class="status-danger">✘</span>' in page


@pytest.mark.e2e
def test_data_docs_are_gx_pages_readable_offline(tmp_path, capsys, chromium):
    """`rlhf validate-preferences FILE --docs DIR`: Great Expectations' own validation-result page
    for the file, with every verdict in the HTML; it fetches nothing (drawn in headless Chromium with
    every host unresolvable, no request but the page itself, no script error) and is the same bytes
    on a second run."""
    from headless_browser import HeadlessChromium, page_url

    rows = pairwise_rows()
    rows[5]["rejected"] = "bell \u0007"
    code, out = check(tmp_path, capsys, rows, docs_dir=str(tmp_path / "docs"))
    assert code == 3 and f"Data Docs: {tmp_path / 'docs' / 'index.html'}" in out
    page = (tmp_path / "docs" / "prefs.html").read_text()
    assert "Expectation Validation Result" in page and "Unsuccessful Expectations" in page
    assert page.count('class="status-danger"') >= 1 and page.count('class="status-success"') >= 10
    fetching = [tag for tag in re.findall(r"<(?:link|script|img)\b[^>]*>", page) if "src=" in tag or "href=" in tag]
    assert fetching == []
    first = {p.name: p.read_bytes() for p in (tmp_path / "docs").iterdir()}
    check(tmp_path, capsys, rows, docs_dir=str(tmp_path / "docs"))
    assert {p.name: p.read_bytes() for p in (tmp_path / "docs").iterdir()} == first

    visible = "({ready: document.readyState, text: document.body.innerText})"
    with HeadlessChromium(chromium) as browser:
        for name in ("index.html", "prefs.html"):
            report = browser.load(page_url(tmp_path / "docs" / name), visible, "v.ready === 'complete'", timeout_s=30)
            assert [url for url in report.requested if not url.startswith("file://")] == []
            assert report.failed == [] and report.errors == []
            assert ("FAILED" if name == "index.html" else "Unsuccessful Expectations") in report.result["text"]
            assert name == "index.html" or "✘" in report.result["text"]


def test_data_docs_show_the_label_share_and_log_no_traceback(tmp_path, capsys, caplog):
    """The label share GX observes is a numpy float, which GX's own number formatter cannot parse
    (it logged two tracebacks per run and showed "--"): the page shows the number, nothing is logged,
    and the page names the file it checked."""
    code, out = check(tmp_path, capsys, best_of_n_rows(), docs_dir=str(tmp_path / "docs"))
    assert code == 0, out
    logged = caplog.text + capsys.readouterr().err
    assert "num_to_str" not in logged and "Traceback" not in logged, logged
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", (tmp_path / "docs" / "prefs.html").read_text()))
    assert f"{tmp_path / 'prefs.jsonl'}: preference-data contract" in text
    assert re.search(r"maximum value must be less than or equal to 0\.95 \. 0\.25 ", text), text


@pytest.mark.parametrize("margin", [float("inf"), float("-inf")])
def test_a_non_finite_margin_is_refused(tmp_path, capsys, margin):
    code, out = check(tmp_path, capsys, with_row(with_margin(best_of_n_rows()), 7, margin=margin), name="prefs.parquet")
    assert code == 3 and "|margin| <= max_abs_margin (100), finite [column margin]: 1 row(s)" in out, out


def test_a_margin_within_the_bound_passes(tmp_path, capsys):
    code, out = check(tmp_path, capsys, with_row(with_margin(best_of_n_rows()), 7, margin=-99.0))
    assert code == 0, out


@pytest.mark.parametrize("splits", [["train"], ["train", "validation"], ["train", "test", "validation"]])
def test_the_cli_refuses_the_split_columns_the_stage_refuses(tmp_path, capsys, splits):
    rows = [dict(r, split=splits[i % len(splits)]) for i, r in enumerate(pairwise_rows())]
    write_jsonl(tmp_path / "prefs.jsonl", rows)
    with pytest.raises(
        DataContractError, match=r"column 'split' must hold both 'train' and 'test' \(and nothing else\); found"
    ):
        validate_file_cli(str(tmp_path / "prefs.jsonl"), params_path=str(tmp_path / "none.yaml"))


def test_a_train_test_split_column_passes_the_cli(tmp_path, capsys):
    rows = [dict(r, split="test" if i % 5 == 0 else "train") for i, r in enumerate(pairwise_rows())]
    write_jsonl(tmp_path / "prefs.jsonl", rows)
    assert validate_file_cli(str(tmp_path / "prefs.jsonl"), params_path=str(tmp_path / "none.yaml")) == 0, (
        capsys.readouterr().out
    )


def test_an_overlong_text_is_never_tokenized(tiny_base_dir):
    """The contract refuses a 5 MB text by its length; the tokenizer never sees it (with a real
    tokenizer a 50 MB row took minutes and gigabytes)."""
    from rlhf_pipeline.models import load_tokenizer

    tokenizer = load_tokenizer(tiny_base_dir)
    longest = []

    def recording(texts, **kwargs):
        longest.append(max(len(t) for t in texts))
        return tokenizer(texts, **kwargs)

    rows = with_row(pairwise_rows(), 3, chosen="y" * 5_000_000)
    flat = to_flat_frame(pd.DataFrame(rows), PAIRWISE)
    result = validate_dataframe(flat, ValidationParams(), recording, label_check=False, names=display_names(PAIRWISE))
    assert not result.success and any("text length <= max_text_chars" in f["check"] for f in result.failures)
    assert longest and max(longest) <= 4000


def test_best_of_1000_costs_the_same_expectations_as_pairwise():
    """The per-text checks run once over all texts, not once per sample column: the suite of a
    best-of-1000 file is as small as a pairwise one's, and a bad text is still named by column."""
    k = 1000
    rows = [
        {"query": f"Query {r}.", **{f"sample{i}": f"Sample {i} for query {r}." for i in range(k)}, "best": r % k}
        for r in range(ROWS)
    ]
    rows[5]["sample700"] = "bell \x07 here"
    result = validate_dataframe(pd.DataFrame(rows), ValidationParams())
    pairwise = validate_dataframe(
        to_flat_frame(pd.DataFrame(pairwise_rows()), PAIRWISE), ValidationParams(), label_check=False
    )
    assert result.expectations == pairwise.expectations + 1  # + the label-share check pairwise data skips
    [failure] = result.failures
    assert failure["column"] == "sample700" and failure["count"] == 1
    assert failure["examples"] == [{"row": 5, "query": "Query 5.", "sample700": "bell \x07 here", "best": 5}]


def hostile_file(tmp_path, case: str):
    """A preference file that once crashed or slipped through (hostile inputs, round 3)."""
    pairs, folder = pairwise_rows(), tmp_path / "data" / "labels"
    folder.mkdir(parents=True, exist_ok=True)
    if case == "mixed formats":
        return write_jsonl(folder / "mixed.jsonl", pairs[:40] + best_of_n_rows()[:40])
    if case == "nested 100,000 deep":
        path = folder / "deep.jsonl"
        deep = '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + ', "chosen": "a", "rejected": "b"}\n'
        path.write_text(deep + "".join(json.dumps(r) + "\n" for r in pairs[1:]))
        return path
    if case == "best as lists":
        path = folder / "bestlist.parquet"
        pd.DataFrame([{**r, "best": [0, 1]} for r in best_of_n_rows()]).to_parquet(path)
        return path
    if case == "sample01 beside sample1":
        return write_jsonl(folder / "zeropad.jsonl", [{**r, "sample01": "x"} for r in best_of_n_rows()])
    if case == "a key given twice":  # json.loads keeps the last `chosen` without a word
        path = write_jsonl(folder / "twice.jsonl", pairs)
        lines = path.read_text().splitlines(keepends=True)
        lines[2] = lines[2].replace('"chosen": ', '"chosen": "the first answer", "chosen": ', 1)
        path.write_text("".join(lines))
        return path
    raise ValueError(case)


FILE_CASES = {
    "mixed formats": "mixes pairwise columns (prompt, chosen, rejected) and best-of-N columns",
    "nested 100,000 deep": "line 1 nests values more than 8 levels deep",
    "best as lists": "column 'best' must hold integers",
    "sample01 beside sample1": "column(s) sample01 look like sample columns but are not named sample0",
    "a key given twice": "line 3 gives the key 'chosen' twice in one object",
}


@pytest.mark.parametrize("case", sorted(FILE_CASES))
@pytest.mark.e2e
def test_a_hostile_file_is_refused_by_the_cli_and_the_stage_alike(project, capsys, case):
    """Each file: exit 3 from `rlhf validate-preferences` and from the preferences stage (not 1, which
    the retrain flow would retry), one paragraph, no traceback."""
    from rlhf_pipeline.cli import main

    path = hostile_file(project, case)
    with pytest.raises(SystemExit) as exit_:
        main(["validate-preferences", str(path), "--params", str(project / "params.yaml")])
    code, cli = exit_.value.code, capsys.readouterr()
    assert code == 3 and "Traceback" not in cli.err + cli.out
    if case != "best as lists":  # the CLI's contract names the column's type instead: tested below
        assert FILE_CASES[case] in cli.out + cli.err
    project.write_params(**{"data.preferences.source": str(path.relative_to(project)), "data.validation.min_rows": 20})
    assert run_stage_script("preferences") == 3
    stage = capsys.readouterr()
    assert FILE_CASES[case] in stage.err and "Traceback" not in stage.err


def test_the_cli_reports_lists_where_labels_belong_and_summarises_long_column_lists(tmp_path, capsys):
    code, out = check(tmp_path, capsys, [{**r, "best": [0, 1]} for r in best_of_n_rows()], name="p.parquet")
    assert code == 3 and "best type (integer) [column best]: 80 row(s)" in out and "best=(0, 1)" in out
    sparse = [{**r, "sample9999": "late"} for r in best_of_n_rows()]
    code, out = check(tmp_path, capsys, sparse)
    assert code == 3 and len(out) < 2000
    assert (
        "[column sample4, sample5, sample6, sample7, sample8, sample9, sample10, sample11, ... and 9,987 more]" in out
    )


def test_a_bidirectional_override_is_refused_like_a_control_character(tmp_path, capsys):
    rows = pairwise_rows()
    rows[3]["chosen"] = "pay \u202eelbuod\u202c now"  # displays reordered: what a reviewer reads is not the text
    code, out = check(tmp_path, capsys, rows)
    assert code == 3 and "control or bidirectional-override characters [column chosen]: 1 row(s)" in out


def test_the_cli_applies_the_stage_s_train_split_and_row_minimum(tmp_path, capsys):
    """96 pairwise rows pass every expectation, but the stage holds out test_fraction 0.5 and would
    refuse the 48 train rows left under min_rows 64: the CLI says so, exit 3."""
    rows = pairwise_rows(96)
    code, out = check(tmp_path, capsys, rows, params={"min_rows": 64})
    assert code == 0  # the reference's test_fraction (0.1) leaves 86 train rows
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"data": {"queries": {"test_fraction": 0.5}, "validation": {"min_rows": 64}}}))
    write_jsonl(tmp_path / "prefs.jsonl", rows)
    code = validate_file_cli(str(tmp_path / "prefs.jsonl"), params_path=str(params))
    out = capsys.readouterr().out
    assert code == 3 and "leaving 48 train row(s), fewer than data.validation.min_rows (64)" in out


@pytest.mark.parametrize("shape", ["best-of-n", "pairwise"])
def test_a_file_validated_in_chunks_reports_what_one_batch_reports(shape, monkeypatch, tiny_tokenizer):
    """The contract on chunks of 7 rows (a big file's path) gives the one-batch result: the same
    failures, counts, examples and order, and the same GX result per expectation. The problems are
    spread over chunks: duplicates across chunks, bad texts, labels out of range, overlong texts."""
    import rlhf_pipeline.contract as contract

    rows = best_of_n_rows(40) if shape == "best-of-n" else pairwise_rows(40)
    text = "sample1" if shape == "best-of-n" else "chosen"
    rows[3][text] = "pay \u202eelbuod\u202c now"
    rows[25][text] = "\u200b\u200b"
    rows[30] = dict(rows[2])  # a duplicate of a row in another chunk
    rows[33] = dict(rows[31])  # and one in the same chunk
    rows[12][text] = "word " * 900  # over max_text_chars (4000) and max_tokens
    if shape == "best-of-n":
        rows[9]["best"], rows[17]["best"] = 7, -1
        rows[20]["sample2"] = rows[20]["sample0"]  # two equal samples in a row
    fmt = BEST_OF_N if shape == "best-of-n" else PAIRWISE
    flat = to_flat_frame(pd.DataFrame(rows), fmt)
    arguments = dict(label_check=shape == "best-of-n", names=display_names(fmt), min_rows=50)
    whole = validate_dataframe(flat, ValidationParams(), tiny_tokenizer, **arguments)
    monkeypatch.setattr(contract, "CHUNK_ROWS", 7)
    chunked = validate_dataframe(flat, ValidationParams(), tiny_tokenizer, **arguments)

    assert not whole.success and len(whole.failures) >= 5
    assert format_summary(chunked) == format_summary(whole)
    assert chunked.failures == whole.failures
    keys = ("success", "element_count", "unexpected_count", "missing_count", "unexpected_index_list", "observed_value")
    outline = lambda result: [  # noqa: E731
        (r["expectation_config"]["type"], r["success"], {k: (r["result"] or {}).get(k) for k in keys if k != "success"})
        for r in result.gx_json["results"]
    ]
    assert outline(chunked) == outline(whole)
