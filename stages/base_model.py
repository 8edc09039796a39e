"""Stage base_model: materialise models/base/ (fp32 safetensors, dedicated pad token, model card)."""

from __future__ import annotations

import _interpreter  # noqa: F401  (first: exit 6 when this Python lacks the project's packages)

import rlhf_pipeline.offline  # noqa: F401  (first: offline and quiet before the Hugging Face libraries load)

from rlhf_pipeline import paths
from rlhf_pipeline.environment import environment_record, record_lines
from rlhf_pipeline.errors import ParamsError
from rlhf_pipeline.fit import model_fit_problems
from rlhf_pipeline.io import atomic_dir
from rlhf_pipeline.modelcard import hub_id, save_card, usage_snippet
from rlhf_pipeline.models import count_parameters, save_tokenizer, set_dropout
from rlhf_pipeline.params import StageParams
from rlhf_pipeline.params.base_model import BaseModelParams
from rlhf_pipeline.params.compute import ComputeParams
from rlhf_pipeline.params.data import DataParams
from rlhf_pipeline.params.ppo import PPOParams
from rlhf_pipeline.params.reward import RewardParams
from rlhf_pipeline.params.task import TaskParams
from rlhf_pipeline.runner import run_stage
from rlhf_pipeline.sources import add_dedicated_pad_token, load_source_model
from rlhf_pipeline.tokens import describe_prefix

OUT = paths.BASE_MODEL


class Params(StageParams):
    compute: ComputeParams = ComputeParams()
    base_model: BaseModelParams = BaseModelParams()
    # read only to check them against the model just built (dvc.yaml declares the few keys)
    data: DataParams = DataParams()
    task: TaskParams = TaskParams()
    reward: RewardParams = RewardParams()
    ppo: PPOParams = PPOParams()


def require_fit_to_model(params: Params, model, tokenizer) -> None:
    """Refuse (exit 2, nothing written) the values that cannot train this model, here at stage 1
    rather than in train_policy after the corpus, labels and reward model are built."""
    problems = model_fit_problems(
        model,
        params.base_model.source,
        params.ppo,
        params.reward.train.num_layers,
        params.data.queries.query_length,
        params.task.response_length,
        tokenizer,
        params.task.truncate_token,
    )
    if problems:
        raise ParamsError("params.yaml", problems)


def prefix_line(prefix: dict) -> str:
    """The card's line on what starts every query, corpus prompt and scored text (none: no line)."""
    if not prefix["ids"]:
        return ""
    return (
        f"- Every sequence starts with the tokenizer's own prefix {prefix['tokens']} (ids {prefix['ids']}), as "
        "its tokenizer adds it: queries, corpus prompts and reward-scored texts.\n"
    )


def source_hash_line(provenance: dict) -> str:
    """The card's line on the source's bytes: what its SHA-256 was taken over (one file, every file of
    a folder), or why there is none."""
    digest = provenance.get("source_sha256")
    if digest is None and "revision" in provenance:
        return f"Source: a hub model at revision `{provenance['revision'] or 'main'}`, not hashed here"
    if digest is None:
        return f"Source: built in ({provenance.get('upstream_format')}), no file to hash"
    if provenance.get("source_file"):
        return f"Source sha256: `{digest}` (of the file `{provenance['source_file']}`)"
    return f"Source sha256: `{digest}` (a local folder: over every file in it)"


def main(params: Params) -> None:
    cfg = params.base_model
    model, tokenizer, provenance = load_source_model(cfg.source, cfg.revision)
    require_fit_to_model(params, model, tokenizer)
    pad_id = add_dedicated_pad_token(model, tokenizer, cfg.pad_token)
    set_dropout(model, cfg.dropout)
    model.eval()
    n_params = count_parameters(model)
    with atomic_dir(OUT, checksums=True) as tmp:
        model.save_pretrained(tmp)
        save_tokenizer(tokenizer, tmp)
        upstream = provenance.get("upstream")
        metadata = {
            "base_model": hub_id(upstream),
            "base_model_relation": "quantized" if hub_id(upstream) and provenance.get("upstream_format") else None,
            "license": provenance.get("license"),
            "library_name": "transformers",
            "pipeline_tag": "text-generation",
            "tags": ["rlhf-pipeline", "base-model"],
            "source": cfg.source,
            "source_format": provenance.get("upstream_format"),
            "source_file": provenance.get("source_file"),
            "source_sha256": provenance.get("source_sha256"),
            "parameters": n_params,
            "pad_token": cfg.pad_token,
            "pad_token_id": pad_id,
            "eos_token_id": tokenizer.eos_token_id,
            "lineage": {"environment": environment_record()},
        }
        prefix = describe_prefix(tokenizer)
        if prefix["ids"]:  # absent: the tokenizer puts nothing before a text (SmolLM2, GPT-2)
            metadata["sequence_prefix"] = prefix
        body = f"""# Base model

Materialised by the `base_model` stage from `{cfg.source}` as fp32 safetensors.

- Parameters: {n_params:,}
- Dedicated pad token `{cfg.pad_token}` (id {pad_id}), distinct from eos (id {tokenizer.eos_token_id}),
  as lm-human-preferences requires.
- Dropout: {cfg.dropout} (the reference trains with dropout off).
{prefix_line(prefix)}- {source_hash_line(provenance)}

This is the frozen reference policy for PPO and the initialisation of the reward model and policy.

## Lineage

{chr(10).join(record_lines(metadata["lineage"]["environment"]))}

## Usage

{usage_snippet(OUT, "base")}
"""
        save_card(tmp, metadata, body)
    print(f"base_model: saved {OUT} ({n_params:,} parameters, pad id {pad_id})")


if __name__ == "__main__":
    run_stage("base_model", main, Params)
