"""Stage queries: OAI query preprocessing of data/corpus (or, task.chat, chat-templated prompts) -> data/queries
(train/test) + metrics."""

from __future__ import annotations

import _interpreter  # noqa: F401  (first: exit 6 when this Python lacks the project's packages)

import rlhf_pipeline.offline  # noqa: F401  (first: offline and quiet before the Hugging Face libraries load)

from datasets import Dataset, DatasetDict, Features, List, Value, load_from_disk

from rlhf_pipeline import paths
from rlhf_pipeline.conversations import read_prompts, require_chat_template
from rlhf_pipeline.errors import ParamsError, PipelineError
from rlhf_pipeline.io import LABELS, atomic_dir, is_local_source, require_tracked_location, write_json
from rlhf_pipeline.models import load_tokenizer, require_dir
from rlhf_pipeline.params import StageParams
from rlhf_pipeline.params.data import SIMULATED, DataParams
from rlhf_pipeline.params.task import TaskParams
from rlhf_pipeline.queries import build_chat_queries, build_queries
from rlhf_pipeline.runner import run_stage

BASE, CORPUS, OUT, METRICS = paths.BASE_MODEL, paths.CORPUS, paths.QUERIES, paths.QUERIES_METRICS
FEATURES = Features({"query_ids": List(Value("int64")), "query": Value("string")})


class Params(StageParams):
    data: DataParams = DataParams()
    task: TaskParams = TaskParams()


def chat_prompts(params: Params) -> list[list[dict]]:
    """task.chat: the prompts of data.queries.prompts, else of the conversational preference data."""
    source = params.data.queries.prompts or params.data.preferences.source
    if source == SIMULATED:
        raise PipelineError(
            "task.chat is on but there are no prompts: set data.queries.prompts to a file of chat prompts, or "
            "data.preferences.source to conversational preference data whose prompts PPO should use."
        )
    key = "data.queries.prompts" if params.data.queries.prompts else "data.preferences.source"
    if is_local_source(source):
        require_tracked_location(source, key, LABELS)
    return read_prompts(source, key)


def main(params: Params) -> None:
    cfg = params.data.queries
    require_dir(BASE, "base_model")
    tokenizer = load_tokenizer(BASE)
    if params.task.chat:
        require_chat_template(tokenizer, "task.chat")
        splits, counts = build_chat_queries(
            chat_prompts(params), tokenizer, cfg.query_length, cfg.test_fraction, params.seed
        )
    else:
        try:
            corpus = load_from_disk(CORPUS)
        except FileNotFoundError:
            raise PipelineError(f"{CORPUS} is missing; run `dvc repro corpus` first.") from None
        splits, counts = build_queries(
            corpus["text"], tokenizer, cfg.query_length, cfg.start_text, cfg.end_text, cfg.test_fraction, params.seed
        )
    if counts["test"] < cfg.min_test_queries:
        kept = f"{counts['kept']} of {counts['prompts'] if params.task.chat else counts['passages']}"
        raise ParamsError(
            "params.yaml",
            [
                f"data.queries.min_test_queries: {cfg.min_test_queries}, but only {counts['test']} held-out queries "
                f"(test_fraction {cfg.test_fraction} of the {kept} kept; {counts}); nothing was written. Give more "
                "passages (data.corpus.num_passages) or prompts, relax the query rules (start_text/end_text, "
                "query_length), raise test_fraction, or lower min_test_queries knowing the evaluation's standard "
                "error grows"
            ],
        )
    with atomic_dir(OUT) as tmp:
        DatasetDict(
            {name: Dataset.from_dict(columns, features=FEATURES) for name, columns in splits.items()}
        ).save_to_disk(str(tmp))
    write_json(METRICS, counts)
    what = "chat prompts" if params.task.chat else "passages"
    total = counts["prompts"] if params.task.chat else counts["passages"]
    print(
        f"queries: {counts['kept']} of {total} {what} kept -> {OUT} (train {counts['train']}, test {counts['test']}); "
        f"{counts}"
    )


if __name__ == "__main__":
    run_stage("queries", main, Params)
