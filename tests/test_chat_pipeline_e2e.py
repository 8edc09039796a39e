"""The whole pipeline in chat mode (task.chat) on a tiny chat model and conversational preference
data: `dvc repro` from a fresh project, prompts rendered with the chat template end to end."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import yaml
from test_pipeline_e2e import REPO, TINY_PARAMS, sh

from rlhf_pipeline.modelcard import read_card
from rlhf_pipeline.params.schema import parse_params

pytestmark = pytest.mark.e2e

TOPICS = ["the film", "the song", "the book", "the trip", "the meal", "the game", "the show", "the park"]


def chat_rows(n: int) -> list[dict]:
    """Conversational preferences in both layouts: a kind reply preferred to a curt one."""
    rows = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        prompt = [{"role": "user", "content": f"What did you think of {topic} number {i}?"}]
        chosen = [{"role": "assistant", "content": "Great, happy."}]  # short: the reply and its end of turn fit
        rejected = [{"role": "assistant", "content": f"Bad {i}."}]
        if i % 2:
            rows.append(
                {
                    "prompt": [{"role": "system", "content": "Be brief."}, *prompt],
                    "chosen": chosen,
                    "rejected": rejected,
                }
            )
        else:  # implicit prompt: whole conversations
            rows.append({"chosen": prompt + chosen, "rejected": prompt + rejected})
    return rows


@pytest.fixture(scope="module")
def chat_project(tmp_path_factory, tiny_chat_base_dir):
    root = tmp_path_factory.mktemp("chat_e2e")
    for item in ("dvc.yaml", "requirements.lock", "stages", "rlhf_pipeline", "data/raw", ".dvcignore"):
        source = REPO / item
        if source.is_dir():
            shutil.copytree(source, root / item, ignore=shutil.ignore_patterns("__pycache__"))
        elif source.exists():
            shutil.copy(source, root / item)
    (root / "data/labels").mkdir(parents=True)
    # one layout per file: the standard rows and the implicit-prompt rows
    rows = chat_rows(96)
    (root / "data/labels/chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if "prompt" in r))
    (root / "data/labels/prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": r["chosen"][:-1]}) + "\n" for r in rows if "prompt" not in r)
    )
    source = root / "data/models/tiny"
    shutil.copytree(tiny_chat_base_dir, source)
    params = json.loads(json.dumps(TINY_PARAMS))
    params["base_model"] = {"source": "data/models/tiny"}
    params["task"] = {"chat": True, "response_length": 16, "truncate_token": None}
    params["data"]["queries"] = {
        "query_length": 32,
        "test_fraction": 0.25,
        "prompts": "data/labels/prompts.jsonl",
        "min_test_queries": 1,
    }
    params["data"]["preferences"] = {"source": "data/labels/chat.jsonl"}
    params["data"]["validation"] = {"min_rows": 16}
    (root / "params.yaml").write_text(yaml.safe_dump(parse_params(params).model_dump(mode="json"), sort_keys=False))
    (root / ".gitignore").write_text("/models/\n/checkpoints/\n/dvclive/\n/data/models/tiny/\n")
    sh(["git", "init", "-q"], root)
    sh(["dvc", "init", "-q"], root)
    sh(["git", "add", "-A"], root)
    sh(["git", "commit", "-qm", "tiny chat project"], root)
    result = sh(["dvc", "repro"], root)
    return root, result


def test_chat_mode_runs_every_stage_on_templated_prompts(chat_project, tiny_chat_base_dir):
    from datasets import load_from_disk

    from rlhf_pipeline.models import load_tokenizer

    root, result = chat_project
    assert "corpus: task.chat is on, so no corpus is needed" in result.stdout
    tokenizer = load_tokenizer(tiny_chat_base_dir)
    generation_prompt = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    queries = load_from_disk(str(root / "data/queries"))
    assert len(queries["train"]) + len(queries["test"]) == 48  # the prompt file's 48 prompts
    for row in queries["train"]:
        assert row["query_ids"][-len(generation_prompt) :] == generation_prompt
        assert row["query"].startswith("<|im_start|>user\nWhat did you think of")
    prefs = load_from_disk(str(root / "data/preferences"))
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert all(end in ids for row in prefs["train"]["sample_ids"] for ids in row)  # replies end their turn
    assert json.loads((root / "metrics/evaluate.json").read_text())
    template_hash = hashlib.sha256(tokenizer.chat_template.encode()).hexdigest()
    for model in ("reward", "policy"):
        card = read_card(root / "models" / model)
        assert card["task_mode"] == "chat" and card["chat_template_sha256"] == template_hash, model
    lineage = sh(["rlhf", "lineage", "models/policy"], root).stdout
    assert "task.chat = true" in lineage and f"chat_template_sha256={template_hash}" in lineage
