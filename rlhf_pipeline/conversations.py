"""Conversational preference data, as TRL, OpenRLHF and verl read it.

Two layouts, told apart by the columns:

- *standard*: ``prompt`` is a list of ``{"role", "content"}`` messages ending with a user turn;
  ``chosen`` and ``rejected`` are each the one assistant message that answers it;
- *implicit prompt*: no ``prompt`` column; ``chosen`` and ``rejected`` are whole conversations that
  share every message but their final assistant turn, and that shared part is the prompt.

Each row is checked message by message (a list of objects with a ``role`` from :data:`ROLES` and
text ``content``, a ``system`` turn only first, the prompt ending with a user turn, one non-empty
assistant reply each, the same prompt in the implicit layout) and refused with its row and field
named. A valid row becomes a plain-text pair: the prompt rendered with the base model's chat
template and its generation prompt, and the two replies; a reply's tokens end with the template's
end-of-turn text, as the policy's replies do. The data contract then checks the texts as it checks
plain pairwise data (chosen != rejected, lengths, duplicates, bad characters).
"""

from __future__ import annotations

import math
import re
from typing import Any

from rlhf_pipeline.errors import DataContractError, PipelineError
from rlhf_pipeline.io import is_local_source, load_hub_dataset, read_table
from rlhf_pipeline.text_rules import text_problem

ROLES = ("system", "user", "assistant")
MAX_LISTED = 10
_VISIBLE = re.compile(r"\S")
_SENTINEL = "\x1fREPLY\x1f"


def as_messages(value: Any) -> list | None:
    """A list (or tuple, or the numpy array Parquet gives) of messages as a list; None otherwise."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if type(value).__name__ == "ndarray":
        return list(value.tolist())
    return None


def is_conversational(frame) -> bool:
    """True when the first non-null ``chosen`` (or ``rejected``) value is a list of messages."""
    for column in ("chosen", "rejected"):
        if column in frame.columns:
            values = [v for v in frame[column].tolist() if v is not None and not (isinstance(v, float) and v != v)]
            if values:
                return as_messages(values[0]) is not None
    return False


def _message_problem(messages: list) -> str | None:
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"message {i} is a {type(message).__name__}, not a {{role, content}} object"
        for key in ("role", "content"):
            if key not in message:
                return f"message {i} has no {key!r}"
        if message["role"] not in ROLES:
            return f"message {i} has role {message['role']!r}; the roles are {', '.join(ROLES)}"
        if not isinstance(message["content"], str):
            return f"message {i} content is a {type(message['content']).__name__}, not text"
        if message["role"] == "system" and i > 0:
            return f"message {i} is a system turn; a system turn may only open the conversation"
    return None


def _prompt_end_problem(prompt: list) -> str | None:
    """A prompt must end with the user's turn: that is what the reply answers."""
    role = prompt[-1]["role"]
    return None if role == "user" else f"the prompt ends with a {role} turn; it must end with the user's"


def _content_problem(messages: list) -> str | None:
    """The first message whose content fails the data contract's text rule: the same rule that refuses
    a preference file's texts, so a prompt file cannot bring into PPO what a label file may not hold."""
    for i, message in enumerate(messages):
        problem = text_problem(message["content"])
        if problem:
            return f"message {i} content fails the data contract's check '{problem}'"
    return None


def _refusal(header: str, problems: list[str]) -> DataContractError:
    """One error listing the first :data:`MAX_LISTED` problems under ``header``."""
    listed = "\n".join(f"- {p}" for p in problems[:MAX_LISTED])
    more = f"\n- ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
    return DataContractError(f"{header}:\n{listed}{more}")


def _reply_problem(reply: list) -> str | None:
    if len(reply) != 1:
        return f"must be one assistant message, got {len(reply)}"
    message = reply[0]
    if message["role"] != "assistant":
        return f"its final turn is a {message['role']} turn, not the assistant's reply"
    if not _VISIBLE.search(message["content"]):
        return "its assistant reply is empty"
    return None


def _row(row: dict, implicit: bool) -> tuple[list, list, list] | tuple[str, str]:
    """(prompt, chosen reply, rejected reply) message lists, or (field, problem)."""
    fields = ("chosen", "rejected") if implicit else ("prompt", "chosen", "rejected")
    lists = {}
    for name in fields:
        messages = as_messages(row.get(name))
        if messages is None:
            return name, f"is a {type(row.get(name)).__name__}, not a list of messages"
        if not messages:
            return name, "is an empty list of messages"
        problem = _message_problem(messages)
        if problem:
            return name, problem
        lists[name] = messages
    if implicit:
        prompt, other = lists["chosen"][:-1], lists["rejected"][:-1]
        if other != prompt:
            differs = next(i for i in range(max(len(prompt), len(other))) if prompt[i : i + 1] != other[i : i + 1])
            return "rejected", f"does not share chosen's prompt (message {differs} differs)"
        lists = {"prompt": prompt, "chosen": lists["chosen"][-1:], "rejected": lists["rejected"][-1:]}
    if not lists["prompt"]:
        return "chosen" if implicit else "prompt", "has no prompt before the assistant reply"
    problem = _prompt_end_problem(lists["prompt"])
    if problem:
        return "chosen" if implicit else "prompt", problem
    for name in ("chosen", "rejected"):
        problem = _reply_problem(lists[name])
        if problem:
            return name, problem
    return lists["prompt"], lists["chosen"], lists["rejected"]


def checked_conversations(frame, where: str) -> list[tuple[list, list, list]]:
    """(prompt, chosen, rejected) message lists per row; DataContractError naming each bad row and field."""
    rows, problems = [], []
    records = frame.to_dict("records")
    for index, row in enumerate(records):
        # each row its own layout: a file may hold both (pandas fills a row's missing prompt with NaN)
        result = _row(row, implicit=_no_prompt(row.get("prompt")))
        if isinstance(result[0], str):
            problems.append(f"row {index}, field {result[0]}: {result[1]}")
        else:
            rows.append(result)
    if problems:
        raise _refusal(
            f"{where}: {len(problems)} of {len(frame)} row(s) are not valid conversations: a prompt, chosen and "
            "rejected, or (no prompt) chosen and rejected conversations that share their prompt "
            f"(messages are {{role, content}} objects, roles {', '.join(ROLES)})",
            problems,
        )
    return rows


def _no_prompt(value: Any) -> bool:
    """A row without a prompt (absent, null, or the NaN pandas puts where another row had one)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def require_chat_template(tokenizer, where: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise PipelineError(
            f"{where}: prompts are rendered with the base model's chat template, and the tokenizer of models/base "
            "has none. Use a chat model as base_model.source (e.g. an -Instruct model); with a plain language "
            "model, keep task.chat false and give preferences as plain-text pairwise rows."
        )


def read_prompts(source: str, where: str) -> list[list[dict]]:
    """Chat prompts of a .jsonl/.parquet file or hub dataset (its train split), each a message list
    ending with the user's turn: a ``prompt`` column of message lists or of user texts, or, without
    one, the shared prompt of ``chosen``/``rejected`` conversations. Refused naming row and field."""
    if is_local_source(source):
        frame = read_table(source)
    else:
        frame = load_hub_dataset(source, None, where)["train"].to_pandas()
    if "prompt" not in frame.columns:
        if {"chosen", "rejected"} <= set(frame.columns) and is_conversational(frame):
            return [prompt for prompt, _, _ in checked_conversations(frame, f"{where} ({source})")]
        raise PipelineError(
            f"{where} ({source}): no 'prompt' column (its columns are {list(map(str, frame.columns))}); give prompts "
            "as a 'prompt' column of role/content message lists or of user texts."
        )
    prompts, problems = [], []
    for index, value in enumerate(frame["prompt"].tolist()):
        messages = [{"role": "user", "content": value}] if isinstance(value, str) else as_messages(value)
        problem = "is not a text or a list of messages" if messages is None else None
        problem = problem or ("is an empty list of messages" if not messages else _message_problem(messages))
        problem = problem or _prompt_end_problem(messages) or _content_problem(messages)
        if problem:
            problems.append(f"row {index}, field prompt: {problem}")
        else:
            prompts.append(messages)
    if problems:
        raise _refusal(f"{where} ({source}): {len(problems)} of {len(frame)} prompt(s) are invalid", problems)
    return prompts


def render_prompt(tokenizer, messages: list) -> str:
    """The prompt as the chat template writes it, ending with the generation prompt."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def end_of_turn(tokenizer) -> str:
    """What the chat template writes right after an assistant reply, up to the first whitespace
    (ChatML: ``<|im_end|>``): the text a reply's tokens end with."""
    sample = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}]
    text = tokenizer.apply_chat_template(sample, tokenize=False)
    after = text.split(_SENTINEL, 1)[1] if _SENTINEL in text else ""
    return after.strip().split()[0] if after.strip() else ""


def plain_prompt(messages: list) -> str:
    """A readable rendering for reports when no tokenizer (so no template) is at hand."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def to_text_pairs(frame, where: str, tokenizer=None):
    """Conversational rows -> plain pairwise rows (``prompt`` rendered with the chat template, or
    as ``role: content`` lines without a tokenizer; ``chosen``/``rejected`` the replies' text),
    keeping ``margin`` and ``split``."""
    import pandas as pd

    if tokenizer is not None:
        require_chat_template(tokenizer, where)
    if not is_conversational(frame):  # plain pairwise rows in chat mode: one user turn, one reply each
        frame = frame.copy()
        for column, role in (("prompt", "user"), ("chosen", "assistant"), ("rejected", "assistant")):
            if column in frame.columns:
                frame[column] = [[{"role": role, "content": v}] if isinstance(v, str) else v for v in frame[column]]
    rows = checked_conversations(frame, where)
    pairs = pd.DataFrame(
        {
            "prompt": [render_prompt(tokenizer, p) if tokenizer is not None else plain_prompt(p) for p, _, _ in rows],
            "chosen": [c[0]["content"] for _, c, _ in rows],
            "rejected": [r[0]["content"] for _, _, r in rows],
        }
    )
    for column in ("margin", "split"):
        if column in frame.columns:
            pairs[column] = frame[column].reset_index(drop=True)
    return pairs


def content_length(value: Any) -> int:
    """Characters of a text, or of all the message contents of a conversation."""
    if isinstance(value, str):
        return len(value)
    messages = as_messages(value) or []
    return sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str))
