"""Stage evaluate: base vs policy on held-out queries, the over-optimisation curve, a report."""

from __future__ import annotations

import _interpreter  # noqa: F401  (first: exit 6 when this Python lacks the project's packages)

import rlhf_pipeline.offline  # noqa: F401  (first: offline and quiet before the Hugging Face libraries load)

import json
from dataclasses import replace
from pathlib import Path

from rlhf_pipeline import paths
from rlhf_pipeline.devices import resolve_compute
from rlhf_pipeline.evaluation import (
    Evaluation,
    curve_point,
    curve_queries,
    length_stats,
    load_snapshot,
    sample_and_score,
    snapshot_matches,
    summarize,
)
from rlhf_pipeline.evaluation_report import sample_rows, write_evaluation
from rlhf_pipeline.io import write_json
from rlhf_pipeline.labelers import gold_labeler
from rlhf_pipeline.models import load_causal_lm, load_tokenizer, require_dir
from rlhf_pipeline.params import StageParams
from rlhf_pipeline.params.compute import ComputeParams
from rlhf_pipeline.params.data import DataParams
from rlhf_pipeline.params.evaluate import EvaluateParams
from rlhf_pipeline.params.ppo import PPOParams
from rlhf_pipeline.params.task import TaskParams
from rlhf_pipeline.ppo.checkpoint import snapshot_update, verified_snapshots
from rlhf_pipeline.queries import load_queries
from rlhf_pipeline.reward.persistence import HEAD_FILE, load_reward_model
from rlhf_pipeline.runner import run_stage
from rlhf_pipeline.sampling import ResponseSampler

BASE, REWARD, POLICY, QUERIES = paths.BASE_MODEL, paths.REWARD, paths.POLICY, paths.QUERIES
SNAPSHOTS = f"{paths.POLICY_CHECKPOINTS}/snapshots"
OUT, METRICS = Path(paths.EVALUATION), paths.EVALUATION_METRICS


class Params(StageParams):
    compute: ComputeParams = ComputeParams()
    data: DataParams = DataParams()
    task: TaskParams = TaskParams()
    evaluate: EvaluateParams = EvaluateParams()
    ppo: PPOParams = PPOParams()  # ppo.kl.estimator: the evaluation's KL is the one PPO penalised


def main(params: Params) -> None:
    cfg = params.evaluate
    require_dir(BASE, "base_model")
    require_dir(REWARD, "normalize_reward", HEAD_FILE)
    require_dir(POLICY, "train_policy")
    snapshots = verified_snapshots(SNAPSHOTS)  # a damaged snapshot stops the stage before anything is sampled
    plan = resolve_compute(params.compute)
    tokenizer = load_tokenizer(BASE)
    base = load_causal_lm(BASE, plan.device).eval()
    policy = load_causal_lm(POLICY, plan.device).eval()
    reward_model = load_reward_model(REWARD, plan.device)
    sampler = ResponseSampler.from_tokenizer(params.task, tokenizer, plan.sampler)
    labeler = gold_labeler(params.data.preferences.source, params.data.preferences.labeler)
    setup = Evaluation(
        base=base,
        reward_model=reward_model,
        queries=load_queries(QUERIES, "test", tokenizer.pad_token_id, cfg.num_queries),
        sampler=sampler,
        tokenizer=tokenizer,
        seed=params.seed + 2,  # same stream for base and policy, distinct from training streams
        batch_size=cfg.batch_size,
        labeler=labeler,
        kl_estimator=params.ppo.kl.estimator,
        responses_per_query=cfg.responses_per_query,
    )
    queries = setup.queries

    def evaluate(model, name: str, on: Evaluation = setup):
        with plan.autocast():
            return sample_and_score(model, on, progress=f"evaluate {name}")

    base_set, policy_set = evaluate(base, "base"), evaluate(policy, "policy")
    metrics = summarize(base_set, policy_set)
    metrics["length/base"] = length_stats(base_set, tokenizer.pad_token_id)
    metrics["length/policy"] = length_stats(policy_set, tokenizer.pad_token_id)
    metrics["queries"] = len(queries)
    metrics["device"] = plan.describe()

    # Over-optimisation curve: the base model at KL 0, every PPO snapshot; the last snapshot holds
    # the shipped policy's weights, so its sample set is the policy's.
    shipped_update = snapshot_update(snapshots[-1]) if snapshots and snapshot_matches(policy, snapshots[-1]) else None
    # the other checkpoints on the first evaluate.curve_queries queries, paired with the base's samples there
    curve_setup = replace(
        setup, queries=queries[: curve_queries(len(queries), cfg.curve_queries, setup.queries_per_batch)]
    )
    points = [curve_point(0, base_set, base_set)]
    for snapshot in snapshots:
        update = snapshot_update(snapshot)
        if update == shipped_update:
            sample = policy_set
        else:
            load_snapshot(policy, snapshot)
            sample = evaluate(policy, f"checkpoint {update}", curve_setup)
        points.append(curve_point(update, sample, base_set))
    pad = tokenizer.pad_token_id
    query_texts = [tokenizer.decode([i for i in ids if i != pad], skip_special_tokens=True) for ids in queries.tolist()]
    write_evaluation(
        OUT, sample_rows(query_texts, base_set, policy_set), points, metrics, cfg.num_table_rows, shipped_update
    )
    write_json(METRICS, metrics)
    print(json.dumps({k: v for k, v in metrics.items() if not isinstance(v, dict)}, indent=1))


if __name__ == "__main__":
    run_stage("evaluate", main, Params)
