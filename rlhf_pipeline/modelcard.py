"""Model cards (``README.md``) for every saved model directory, written and read with
``huggingface_hub``'s ``ModelCard``/``ModelCardData``.

The metadata names ``base_model`` and ``datasets`` in hub form only where the pipeline knows a hub
id (the embedded SmolLM2 comes from ``HuggingFaceTB/SmolLM2-135M-Instruct``; a hub source is its
own id); everything else (local folders, the content hash of each input) is the card's
``lineage`` key and its Lineage section.

A card holds only what follows from the stage's inputs and params: no git commit, dirty flag,
timestamp, run time or machine path, so the same inputs write the same card bytes and a commit
or a rerun does not make the stages downstream stale. Which commit recorded a model, and when,
is git's and ``dvc.lock``'s to say: ``rlhf lineage`` reads them there.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

import yaml

from rlhf_pipeline.environment import environment_record, record_lines
from rlhf_pipeline.io import atomic_file, content_hash

CARD = "README.md"
# owner/name as the Hub spells repository ids (a local path that happens to match is not one)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_id(value: Any) -> str | None:
    """``value`` when it is a hub repository id rather than a local path."""
    if isinstance(value, str) and HUB_ID.match(value) and not Path(value).exists():
        return value
    return None


def read_card(directory: str | os.PathLike) -> dict[str, Any]:
    """The metadata of ``directory``'s model card; {} when it has none."""
    from huggingface_hub import ModelCard

    path = Path(directory, CARD)
    if not path.is_file() or not path.read_text(errors="replace").startswith("---"):
        return {}  # no metadata block (ModelCard would warn and return empty data)
    return ModelCard.load(path).data.to_dict()


def save_card(directory: str | os.PathLike, metadata: dict[str, Any], body: str) -> None:
    """Write ``README.md``: ``metadata`` through ``ModelCardData`` (the Hub's field names and
    checks), then ``body``."""
    from huggingface_hub import ModelCard, ModelCardData

    data = ModelCardData(**{k: v for k, v in metadata.items() if v is not None})
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body.strip()}\n")
    with atomic_file(Path(directory, CARD)) as handle:
        handle.write(str(card))


def usage_snippet(target: str, kind: str, reward_pooling: str | None = None) -> str:
    """How to load the model at ``target``: a policy with transformers; a reward model with this
    package, and (last-token pooling) as a stock transformers sequence classifier."""
    if kind == "reward":
        project = f"""```python
from rlhf_pipeline.reward.persistence import load_reward_model

reward_model = load_reward_model("{target}")
print(reward_model.score(["The movie was"], [" a delight from start to end."]))  # normalised rewards
```"""
        if reward_pooling != "last":
            return project + (
                "\n\nIt pools the mean over the response tokens, which no stock transformers class does: "
                "a stock `AutoModel*` load of this folder fails, naming `load_reward_model`."
            )
        return f"""```python
from transformers import AutoModelForSequenceClassification, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{target}")
model = AutoModelForSequenceClassification.from_pretrained("{target}")
inputs = tokenizer(["The movie was great fun"], return_tensors="pt", padding=True)  # pads on the right
score = model(**inputs).logits[:, 0] + model.config.reward_offset  # the normalised reward PPO used
```

or with this package:

{project}"""
    trained = kind == "policy"
    padding = "  # pads on the left, for batched generation" if trained else ""
    sampling = "  # generation_config.json: the sampling settings PPO trained with" if trained else ""
    return f"""```python
from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{target}"){padding}
model = AutoModelForCausalLM.from_pretrained("{target}")
inputs = tokenizer(["The movie was"], return_tensors="pt", padding=True)
output = model.generate(**inputs, max_new_tokens=24){sampling}
print(tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
```"""


# What a user of each kind of model should know before relying on it (the card's Limitations).
LIMITATIONS = {
    "reward": [
        "It scores what its labels preferred, on the distribution it was trained on (the base model's "
        "samples on this project's queries); far from those, its scores mean little.",
        "Its held-out accuracy is measured on labels from the same source as its training labels: it says "
        "how well it imitates that labeller, not whether the labeller is right.",
        "A policy optimised against it finds what it over-rewards: watch the gold score against the KL "
        "(the evaluate stage's over-optimisation curve).",
    ],
    "policy": [
        "It was optimised against a learned reward model (a proxy): a high proxy score at a large KL from "
        "the base is reward hacking, not quality. Its held-out gold and proxy gain, KL and win rates are the "
        "evaluate stage's (`evaluation/report.md`, `metrics/evaluate.json`), measured after this card was "
        "written.",
        "It inherits the base model's knowledge, biases and languages; the preference data moved its style, "
        "not its facts.",
        "The CPU default is a demonstration: a 135M model, a few hundred episodes and a simulated labeller.",
    ],
}


def preference_data_line(source: str, labeler: str | None) -> str:
    """One line on the preference data a model learnt from: simulated labels (the labeller that
    ranked the base model's samples), a local file, or a hub dataset."""
    if source == "simulated":
        return (
            f"Simulated labels: base-model samples for this project's queries, ranked by the `{labeler}` labeller "
            "(a scorer standing in for people; the same labeller is the evaluation's gold judge)."
        )
    if hub_id(source):
        return f"The hub dataset `{source}` (data.preferences.source), converted and checked by the data contract."
    return f"The label file `{source}` (data.preferences.source), converted and checked by the data contract."


def held_out_result(metric: str, value: float, dataset: str, metric_type: str, task: str = "text-classification"):
    """One ``model-index`` entry: ``metric`` measured on held-out ``dataset`` (4 decimals)."""
    from huggingface_hub import EvalResult

    return EvalResult(
        task_type=task,
        dataset_type="rlhf-pipeline-held-out",
        dataset_name=dataset,
        dataset_split="test",
        metric_type=metric_type,
        metric_name=metric,
        metric_value=round(float(value), 4),
    )


def add_held_out_results(directory: str | os.PathLike, results: list, source: str) -> None:
    """Put ``results`` (``huggingface_hub.EvalResult``s) in the card of ``directory`` as its ``model-index``,
    and say under Evaluation where they were read (``source``). For a model whose held-out evaluation
    ran after its card was written (the policy: the evaluate stage reads the finished model)."""
    from huggingface_hub import ModelCard

    card = ModelCard.load(Path(directory, CARD))
    card.data.eval_results = results
    card.data.model_name = card.data.model_name or next(
        (line[2:].strip() for line in card.text.splitlines() if line.startswith("# ")), Path(directory).name
    )
    listed = "".join(f"- {r.metric_name}: {r.metric_value:.4g}\n" for r in results)
    card.text = card.text.replace(
        "## Evaluation\n\n",
        f"## Evaluation\n\nHeld-out results (also the card's model-index), from {source}:\n\n{listed}\n",
        1,
    )
    with atomic_file(Path(directory, CARD)) as handle:
        handle.write(str(card))


def write_card(
    directory: str | os.PathLike,
    *,
    target: str,
    kind: str,
    title: str,
    summary: str,
    base_dir: str,
    tags: list[str],
    hyperparameters: dict,
    metrics: dict,
    inputs: list[str],
    device: str,
    datasets: list[str] | None = None,
    data: list[str] | None = None,
    eval_results: list | None = None,
    extra_metadata: dict | None = None,
    reward_pooling: str | None = None,
    chat_template: str | None = None,
) -> None:
    """The card of a model trained from ``base_dir``: its base model and licence come from that
    model's card; ``target`` is where the model lands (not the temporary folder it is written to).
    ``data``: lines on what it learnt from (its Training data section); ``eval_results``:
    ``huggingface_hub.EvalResult``s of held-out measurements, the card's ``model-index``;
    the Limitations section is :data:`LIMITATIONS` of ``kind``; ``device``: what the stage ran on
    (:meth:`rlhf_pipeline.devices.DevicePlan.describe`)."""
    base = read_card(base_dir)
    hashes = {str(p): content_hash(p) for p in inputs if Path(p).exists()}
    environment = environment_record()
    # a mean-pooling reward model has no transformers class (rlhf_pipeline.reward loads it)
    transformers_class = kind != "reward" or reward_pooling == "last"
    metadata = {
        "base_model": hub_id(base.get("base_model")),
        "datasets": [d for d in map(hub_id, datasets or []) if d] or None,
        "license": base.get("license"),
        "library_name": "transformers" if transformers_class else None,
        "pipeline_tag": {"policy": "text-generation", "reward": "text-classification"}.get(kind)
        if transformers_class
        else None,
        "tags": ["rlhf-pipeline", *tags],
        # task.chat: the prompts were rendered with this template (its hash: the template text is in the tokenizer)
        "task_mode": "chat" if chat_template else "continuation",
        "chat_template_sha256": hashlib.sha256(chat_template.encode()).hexdigest() if chat_template else None,
        "device": device,
        # model-index: the Hub reads held-out results from here (it needs the model's name beside them)
        "model_name": title if eval_results else None,
        "eval_results": eval_results or None,
        "lineage": {
            "base_model_dir": base_dir,
            "inputs": hashes,
            "environment": environment,
        },
        **(extra_metadata or {}),
    }
    lineage = [
        f"- device: {device}",
        "- task: " + ("chat (prompts in the tokenizer's chat template)" if chat_template else "continuation"),
    ]
    lineage += [f"- input `{p}`: sha256 `{h}`" for p, h in hashes.items()]
    lineage += record_lines(environment)
    evaluation = [f"- `{k}`: {v:.4f}" if isinstance(v, float) else f"- `{k}`: {v}" for k, v in metrics.items()]
    body = [f"# {title}", "", summary.strip(), "", "## Usage", "", usage_snippet(target, kind, reward_pooling), ""]
    if data:
        body += ["## Training data", "", *(f"- {line}" for line in data), ""]
    body += ["## Training procedure and hyperparameters", "", "```yaml"]
    body += [yaml.safe_dump(hyperparameters, sort_keys=False).strip(), "```", "", "## Evaluation", ""]
    body += [*(evaluation or ["(none)"]), ""]
    if kind in LIMITATIONS:
        body += ["## Limitations", "", *(f"- {line}" for line in LIMITATIONS[kind]), ""]
    body += ["## Lineage", "", *lineage, "", f"Full chain: `rlhf lineage {target}`."]
    save_card(directory, metadata, "\n".join(body))
