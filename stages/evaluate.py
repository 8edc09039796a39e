"""Stage evaluate: base vs policy on held-out queries, the over-optimisation curve, a report."""

from __future__ import annotations

import rlhf_pipeline.offline  # noqa: F401  (first: offline and quiet before the Hugging Face libraries load)

import csv
import json
from pathlib import Path

from rlhf_pipeline.evaluation import (
    Evaluation,
    curve_point,
    length_stats,
    load_snapshot,
    overoptimization_plot,
    sample_and_score,
    snapshot_matches,
    summarize,
)
from rlhf_pipeline.io import atomic_file, write_json
from rlhf_pipeline.labelers import gold_labeler
from rlhf_pipeline.models import load_causal_lm, load_tokenizer, require_dir
from rlhf_pipeline.params import StageParams
from rlhf_pipeline.params.data import DataParams
from rlhf_pipeline.params.evaluate import EvaluateParams
from rlhf_pipeline.params.ppo import PPOParams
from rlhf_pipeline.params.task import TaskParams
from rlhf_pipeline.ppo.checkpoint import verified_snapshots
from rlhf_pipeline.queries import load_queries
from rlhf_pipeline.reward import HEAD_FILE, RewardModel
from rlhf_pipeline.runner import run_stage
from rlhf_pipeline.sampling import ResponseSampler

BASE, REWARD, POLICY, QUERIES, SNAPSHOTS = (
    "models/base",
    "models/reward",
    "models/policy",
    "data/queries",
    "checkpoints/policy/snapshots",
)
OUT = Path("evaluation")
METRICS = "metrics/evaluate.json"


class Params(StageParams):
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
    tokenizer = load_tokenizer(BASE)
    base = load_causal_lm(BASE).eval()
    policy = load_causal_lm(POLICY).eval()
    reward_model = RewardModel.load(REWARD)
    sampler = ResponseSampler.from_tokenizer(params.task, tokenizer)
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
    )
    queries = setup.queries

    def evaluate(model, name: str):
        return sample_and_score(model, setup, progress=f"evaluate {name}")

    base_set, policy_set = evaluate(base, "base"), evaluate(policy, "policy")
    metrics = summarize(base_set, policy_set)
    metrics["length/base"] = length_stats(base_set, tokenizer.pad_token_id)
    metrics["length/policy"] = length_stats(policy_set, tokenizer.pad_token_id)
    metrics["queries"] = len(queries)

    # Over-optimisation curve: the base model at KL 0, every PPO snapshot; the last snapshot holds
    # the shipped policy's weights, so its sample set is the policy's.
    shipped_update = (
        int(snapshots[-1].stem.split("_")[1]) if snapshots and snapshot_matches(policy, snapshots[-1]) else None
    )
    points = [curve_point(0, base_set, base_set)]
    for snapshot in snapshots:
        update = int(snapshot.stem.split("_")[1])
        if update == shipped_update:
            sample = policy_set
        else:
            load_snapshot(policy, snapshot)
            sample = evaluate(policy, f"checkpoint {update}")
        points.append(curve_point(update, sample, base_set))
    best = max(points, key=lambda p: p["gold"] if p["gold"] is not None else p["proxy"])

    OUT.mkdir(exist_ok=True)
    decode = lambda ids: tokenizer.decode([i for i in ids if i != tokenizer.pad_token_id], skip_special_tokens=True)  # noqa: E731
    rows = []  # every held-out query: the promotion gate pairs versions on these (rlhf models gate)
    for i in range(len(queries)):
        rows.append(
            {
                "query": decode(queries[i].tolist()),
                "base_response": base_set.texts[i],
                "policy_response": policy_set.texts[i],
                "base_proxy": round(base_set.proxy[i].item(), 4),
                "policy_proxy": round(policy_set.proxy[i].item(), 4),
                "base_gold": None if base_set.gold is None else round(float(base_set.gold[i]), 4),
                "policy_gold": None if policy_set.gold is None else round(float(policy_set.gold[i]), 4),
                "kl": round(policy_set.kl[i].item(), 4),
            }
        )
    with atomic_file(OUT / "responses.jsonl", "w") as handle:
        handle.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    rows = [{k: v for k, v in row.items() if k != "kl"} for row in rows[: cfg.num_table_rows]]
    with atomic_file(OUT / "samples.csv", "w") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    write_json(OUT / "samples.json", rows)
    write_json(OUT / "overoptimization.json", points)
    png = OUT / "overoptimization.png"
    tmp_png = OUT / ".overoptimization.tmp.png"
    overoptimization_plot(points, tmp_png, shipped_update)
    tmp_png.replace(png)
    with atomic_file(OUT / "report.md") as handle:
        handle.write(render_report(metrics, points, best, rows))
    write_json(METRICS, metrics)
    print(json.dumps({k: v for k, v in metrics.items() if not isinstance(v, dict)}, indent=1))


def _fmt(value) -> str:
    if isinstance(value, str):  # a reason, e.g. why an improvement is undefined
        return value
    return "n/a" if value is None else f"{value:.3f}"


def _with_error(point: dict, key: str) -> str:
    if point.get(f"{key}_std_units") is None:
        return "n/a"
    return f"{point[f'{key}_std_units']:+.3f} +- {point[f'{key}_stderr']:.3f}"


def render_report(metrics: dict, points: list[dict], best: dict, rows: list[dict]) -> str:
    lines = [
        "# Evaluation report",
        "",
        f"Held-out test queries: {metrics['queries']}. Base and policy sampled with the same seed.",
        "",
        "| metric | value |",
        "|---|---|",
    ]
    for key, value in metrics.items():
        if not isinstance(value, dict) and key != "queries":
            lines.append(f"| `{key}` | {_fmt(value)} |")
    lines += [
        "",
        "## Reward over-optimisation",
        "",
        "![over-optimisation curve](overoptimization.png)",
        "",
        "Improvements are over the base model on the same queries, in base-std units, +- one paired standard error.",
        "",
        "| update | KL | proxy | gold | proxy improvement | gold improvement |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {p['update']} | {p['kl']:.3f} | {p['proxy']:.3f} | {_fmt(p['gold'])} | {_with_error(p, 'proxy')} | "
        f"{_with_error(p, 'gold')} |"
        for p in points
    ]
    criterion = "gold" if best["gold"] is not None else "proxy"
    scores = f"(proxy {best['proxy']:.3f}, gold {_fmt(best['gold'])}, KL {best['kl']:.3f})"
    if best["update"]:
        verdict = (
            f"Best checkpoint by {criterion} score: **update {best['update']}** {scores}; "
            f"its weights are `checkpoints/policy/snapshots/update_{best['update']:05d}.safetensors`."
        )
    else:
        verdict = (
            f"Best checkpoint by {criterion} score: **the base model (update 0)** {scores}: no PPO checkpoint "
            "improved on it."
        )
    lines += ["", verdict, "", "## Samples", "", "Full table: [samples.csv](samples.csv). First rows:", ""]
    for row in rows[:5]:
        lines += [
            f"- **query**: {row['query']!r}",
            f"  - base ({_fmt(row['base_gold'])} gold): {row['base_response']!r}",
            f"  - policy ({_fmt(row['policy_gold'])} gold): {row['policy_response']!r}",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    run_stage("evaluate", main, Params)
