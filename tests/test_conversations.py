"""Conversational preference data (rlhf_pipeline.conversations): detection, the message checks
with the row and field named, rendering with the chat template, and the preferences stage on it."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from conftest import run_stage_script

from rlhf_pipeline.conversations import end_of_turn, render_prompt, to_text_pairs
from rlhf_pipeline.errors import DataContractError, PipelineError
from rlhf_pipeline.models import load_tokenizer
from rlhf_pipeline.preferences.formats import CONVERSATIONAL, PAIRWISE, detect_format, to_flat_frame
from rlhf_pipeline.text_rules import BAD_CHARACTER_CHECK, EMPTY_TEXT_CHECK


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


SYSTEM = {"role": "system", "content": "Be kind."}


def standard_rows(n=12):
    return [
        {
            "prompt": [SYSTEM, user(f"How was movie {i}?")],
            "chosen": [assistant(f"Movie {i} was a delight, warm and funny.")],
            "rejected": [assistant(f"Movie {i} was dull.")],
        }
        for i in range(n)
    ]


def implicit_rows(n=12):
    return [
        {
            "chosen": [user(f"Tell me about day {i}."), assistant(f"Day {i} was wonderful.")],
            "rejected": [user(f"Tell me about day {i}."), assistant(f"Day {i} was awful.")],
        }
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def chat_tokenizer(tiny_chat_base_dir):
    return load_tokenizer(tiny_chat_base_dir)


def test_both_layouts_are_detected_and_become_text_pairs(chat_tokenizer, tmp_path):
    for rows, asked, chosen in (
        (standard_rows(), "How was movie 3?", "Movie 3 was a delight, warm and funny."),
        (implicit_rows(), "Tell me about day 3.", "Day 3 was wonderful."),
    ):
        frame = pd.DataFrame(rows)
        assert detect_format(frame, "f") == CONVERSATIONAL
        pairs = to_text_pairs(frame, "f", chat_tokenizer)
        assert list(pairs.columns) == ["prompt", "chosen", "rejected"] and pairs["chosen"][3] == chosen
        assert pairs["prompt"][3].endswith(f"<|im_start|>user\n{asked}<|im_end|>\n<|im_start|>assistant\n")
    # Parquet hands lists of messages back as numpy arrays of dicts
    path = tmp_path / "chat.parquet"
    pd.DataFrame(standard_rows()).to_parquet(path)
    frame = pd.read_parquet(path)
    assert detect_format(frame, "f") == CONVERSATIONAL
    assert to_text_pairs(frame, "f", chat_tokenizer)["chosen"][0] == "Movie 0 was a delight, warm and funny."
    assert detect_format(pd.DataFrame([{"prompt": "p", "chosen": "a", "rejected": "b"}]), "f") == PAIRWISE


def test_the_prompt_is_the_chat_template_s_with_the_generation_prompt(chat_tokenizer):
    text = render_prompt(chat_tokenizer, [SYSTEM, user("Hi")])
    assert text == "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert end_of_turn(chat_tokenizer) == "<|im_end|>"


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (
            lambda r: r["chosen"].__setitem__(0, {"role": "bot", "content": "x"}),
            "row 2, field chosen: message 0 has role 'bot'",
        ),
        (lambda r: r["prompt"][1].pop("role"), "row 2, field prompt: message 1 has no 'role'"),
        (lambda r: r["rejected"][0].__setitem__("content", 5), "row 2, field rejected: message 0 content is a int"),
        (lambda r: r["prompt"].append(SYSTEM), "row 2, field prompt: message 2 is a system turn"),
        (lambda r: r["prompt"].append(assistant("hm")), "row 2, field prompt: the prompt ends with a assistant turn"),
        (lambda r: r["chosen"].__setitem__(0, assistant("   ")), "row 2, field chosen: its assistant reply is empty"),
        (lambda r: r["chosen"].append(user("and?")), "row 2, field chosen: must be one assistant message, got 2"),
        (lambda r: r.__setitem__("rejected", "plain text"), "row 2, field rejected: is a str, not a list of messages"),
        (lambda r: r.__setitem__("prompt", []), "row 2, field prompt: is an empty list of messages"),
        (
            lambda r: r["chosen"].__setitem__(0, "hello"),
            "row 2, field chosen: message 0 is a str, not a {role, content}",
        ),
    ],
)
def test_a_malformed_conversation_is_refused_naming_row_and_field(chat_tokenizer, mutate, expected):
    rows = standard_rows()
    mutate(rows[2])
    with pytest.raises(DataContractError, match="1 of 12 row") as caught:
        to_text_pairs(pd.DataFrame(rows), "data/labels/chat.jsonl", chat_tokenizer)
    assert expected in str(caught.value) and "data/labels/chat.jsonl" in str(caught.value)


def test_implicit_prompts_must_be_shared(chat_tokenizer):
    rows = implicit_rows()
    rows[4]["rejected"][0] = user("Tell me about another day.")
    with pytest.raises(DataContractError, match=r"row 4, field rejected: does not share chosen's prompt \(message 0"):
        to_text_pairs(pd.DataFrame(rows), "f", chat_tokenizer)


def test_a_base_model_without_a_chat_template_is_refused(tiny_tokenizer):
    with pytest.raises(PipelineError, match="tokenizer of models/base has none"):
        to_text_pairs(pd.DataFrame(standard_rows()), "f", tiny_tokenizer)


def test_the_contract_checks_the_replies_as_it_checks_pairwise_texts(chat_tokenizer):
    from rlhf_pipeline.contract import validate_dataframe
    from rlhf_pipeline.params.data import ValidationParams
    from rlhf_pipeline.preferences.formats import display_names

    rows = standard_rows()
    rows[5]["rejected"] = rows[5]["chosen"]  # chosen == rejected
    rows[7]["chosen"] = [assistant("bell \u0007")]
    flat = to_flat_frame(pd.DataFrame(rows), CONVERSATIONAL, chat_tokenizer)
    result = validate_dataframe(
        flat, ValidationParams(min_rows=4), chat_tokenizer, label_check=False, names=display_names(CONVERSATIONAL)
    )
    checks = {f["check"]: f for f in result.failures}
    assert not result.success
    assert "distinct samples in a row (chosen != rejected)" in checks
    assert any(
        "control or bidirectional-override characters" in name and "chosen" in str(f["column"])
        for name, f in checks.items()
    )


@pytest.mark.e2e
def test_preferences_stage_reads_conversational_jsonl(project, tiny_chat_base_dir):
    from datasets import load_from_disk

    from rlhf_pipeline.io import read_json

    (project / "models" / "base").unlink()
    (project / "models" / "base").symlink_to(tiny_chat_base_dir, target_is_directory=True)
    (project / "data" / "labels").mkdir(parents=True)
    path = project / "data" / "labels" / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in standard_rows(40)))
    project.write_params(
        **{
            "data.preferences.source": "data/labels/chat.jsonl",
            "data.validation.min_rows": 20,
            "task.response_length": 40,
            "task.chat": True,
        }
    )
    assert run_stage_script("preferences") == 0
    assert run_stage_script("validate_preferences") == 0
    assert read_json(project / "data" / "preferences" / "format.json")["format"] == CONVERSATIONAL
    tokenizer = load_tokenizer(tiny_chat_base_dir)
    row = load_from_disk(str(project / "data" / "preferences"))["train"][0]
    generation_prompt = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert row["query_ids"][-len(generation_prompt) :] == generation_prompt  # left truncation keeps the end
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    chosen = [t for t in row["sample_ids"][0] if t != tokenizer.pad_token_id]
    assert end in chosen and tokenizer.decode(chosen[: chosen.index(end)]) == row["samples"][0]
    assert read_json(project / "data" / "validation" / "summary.json")["success"] is True


def test_chat_sampler_stops_at_the_template_s_end_of_turn(chat_tokenizer, tiny_tokenizer):
    from rlhf_pipeline.params.task import TaskParams
    from rlhf_pipeline.sampling import ResponseSampler

    sampler = ResponseSampler.from_tokenizer(TaskParams(chat=True, truncate_token=None), chat_tokenizer)
    assert sampler.eos_token_id == chat_tokenizer.convert_tokens_to_ids("<|im_end|>") != chat_tokenizer.eos_token_id
    assert sampler.stop_at_eos is True
    plain = ResponseSampler.from_tokenizer(TaskParams(), chat_tokenizer)
    assert plain.eos_token_id == chat_tokenizer.eos_token_id and plain.stop_at_eos is None  # reference path as before
    with pytest.raises(PipelineError, match="task.chat: prompts are rendered with the base model's chat template"):
        ResponseSampler.from_tokenizer(TaskParams(chat=True), tiny_tokenizer)


@pytest.mark.e2e
def test_queries_stage_in_chat_mode_renders_the_prompt_file(project, tiny_chat_base_dir):
    from datasets import load_from_disk

    (project / "models" / "base").unlink()
    (project / "models" / "base").symlink_to(tiny_chat_base_dir, target_is_directory=True)
    prompts = [{"prompt": f"Say something about day {i}."} for i in range(10)]  # texts: one user turn each
    prompts += [{"prompt": [SYSTEM, user(f"Describe night {i}.")]} for i in range(10)]
    prompts += prompts[:3]  # repeated prompts are kept once
    (project / "data" / "labels").mkdir(parents=True, exist_ok=True)
    (project / "data" / "labels" / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    project.write_params(
        **{"task.chat": True, "data.queries.prompts": "data/labels/prompts.jsonl", "data.queries.query_length": 12}
    )
    assert run_stage_script("queries") == 0
    queries = load_from_disk(str(project / "data" / "queries"))
    tokenizer = load_tokenizer(tiny_chat_base_dir)
    rows = list(queries["train"]) + list(queries["test"])
    assert len(rows) == 20
    generation_prompt = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    for row in rows:
        assert len(row["query_ids"]) == 12 and row["query_ids"][-len(generation_prompt) :] == generation_prompt
        assert row["query"].startswith("<|im_start|>")


@pytest.mark.e2e
def test_chat_mode_without_prompts_or_template_is_refused(project, capsys, tiny_chat_base_dir):
    project.write_params(**{"task.chat": True})  # preferences are simulated: no prompts anywhere
    (project / "models" / "base").unlink()
    (project / "models" / "base").symlink_to(tiny_chat_base_dir, target_is_directory=True)
    assert run_stage_script("queries") == 1
    assert "task.chat is on but there are no prompts" in capsys.readouterr().err


@pytest.mark.e2e
def test_conversational_data_needs_chat_mode(project, tiny_chat_base_dir, capsys):
    (project / "models" / "base").unlink()
    (project / "models" / "base").symlink_to(tiny_chat_base_dir, target_is_directory=True)
    (project / "data" / "labels").mkdir(parents=True, exist_ok=True)
    (project / "data" / "labels" / "chat.jsonl").write_text(
        "".join(json.dumps(row) + "\n" for row in standard_rows(20))
    )
    project.write_params(**{"data.preferences.source": "data/labels/chat.jsonl"})
    assert run_stage_script("preferences") == 1
    assert "task.chat is false" in capsys.readouterr().err


def test_a_bad_prompt_file_is_refused_naming_row_and_field(tmp_path):
    from rlhf_pipeline.conversations import read_prompts

    path = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": "Hello there."},
        {"prompt": [user("Hi"), assistant("Hello")]},
        {"prompt": 7},
        {"prompt": "Ring \x07 the bell."},
        {"prompt": [{"role": "system", "content": "\u200b"}, user("Hi")]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataContractError, match="4 of 5 prompt") as caught:
        read_prompts(str(path), "data.queries.prompts")
    assert "row 1, field prompt: the prompt ends with a assistant turn; it must end with the user's" in str(
        caught.value
    )
    assert "row 2, field prompt: is not a text or a list of messages" in str(caught.value)
    # the data contract's text rule, as for a preference file's texts
    assert f"row 3, field prompt: message 0 content fails the data contract's check '{BAD_CHARACTER_CHECK}'" in str(
        caught.value
    )
    assert f"row 4, field prompt: message 0 content fails the data contract's check '{EMPTY_TEXT_CHECK}'" in str(
        caught.value
    )


def test_the_guide_s_chat_example_reads_as_written(chat_tokenizer, tmp_path):
    """The two rows of docs/own_model_and_data.md, one with a prompt and one without (its prompt is
    the conversations' shared part), in one file: each row is read in its own layout."""
    from pathlib import Path

    from rlhf_pipeline.io import read_table

    readme = (Path(__file__).resolve().parents[1] / "docs/own_model_and_data.md").read_text()
    block = readme.split("cat > data/labels/chat.jsonl <<'JSONL'\n", 1)[1].split("\nJSONL\n", 1)[0]
    (tmp_path / "chat.jsonl").write_text(block + "\n")
    frame = read_table(tmp_path / "chat.jsonl")
    assert detect_format(frame, "chat.jsonl") == CONVERSATIONAL
    pairs = to_text_pairs(frame, "chat.jsonl", chat_tokenizer)
    assert pairs["chosen"].tolist() == ["Wonderful, I loved it.", "Bright and happy."]
    assert pairs["rejected"].tolist() == ["Dull.", "Grey."]
    assert "Describe your day." in pairs["prompt"][1] and "How was the film?" in pairs["prompt"][0]
