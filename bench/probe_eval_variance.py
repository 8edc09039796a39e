"""Probe: where the evaluation's noise comes from, and what more responses or more queries would buy.

Issue 50's criterion (every seed at gold >= +0.8 sigma and exact KL <= 6 on the test queries) is read
from one evaluation: one response per held-out query. This samples the base model and the shipped policy
(`models/policy`) ``--draws`` times on every test query (each draw its own random stream, base and policy
on the same one, paired as the evaluation pairs them), scores gold and the exact KL as `evaluate` does,
and splits each per-response measure's variance into a between-query part and a within-query part (one-way
random effects, balanced):

    MS_within = sum_ij (x_ij - mean_i)^2 / (n (m - 1)),  MS_between = m sum_i (mean_i - mean)^2 / (n - 1)
    var_within = MS_within,  var_query = max(MS_between - MS_within, 0) / m
    SE(n queries, r responses each) = sqrt((var_query + var_within / r) / n)

Usage (after `dvc repro`, alone on the machine):

    .venv/bin/python bench/probe_eval_variance.py --draws 3 --output bench/results/eval_variance_probe.md
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from common import emit, measured_matmul_flops  # noqa: E402
from shipped_run import load_shipped_run, probe_parser  # noqa: E402

from rlhf_pipeline import paths  # noqa: E402
from rlhf_pipeline.evaluation import sample_and_score  # noqa: E402
from rlhf_pipeline.labelers import gold_labeler  # noqa: E402
from rlhf_pipeline.queries import load_queries  # noqa: E402


def variance_components(values: np.ndarray) -> tuple[float, float]:
    """(between-query, within-query) variance of ``values`` shaped (queries, responses per query)."""
    n, m = values.shape
    means = values.mean(1)
    within = float(((values - means[:, None]) ** 2).sum() / (n * (m - 1)))
    between = float(m * ((means - means.mean()) ** 2).sum() / (n - 1))
    return max(between - within, 0.0) / m, within


def standard_error(var_query: float, var_within: float, queries: int, responses: int) -> float:
    return math.sqrt((var_query + var_within / responses) / queries)


def main() -> None:
    parser = probe_parser(__doc__, draws=3, draws_help="responses per test query (each its own stream)")
    args = parser.parse_args()
    if args.draws < 2:
        parser.error("--draws must be at least 2: the within-query variance needs two responses per query")
    run = load_shipped_run(args.policy)
    data = run.params.data.preferences
    labeler = gold_labeler(data.source, data.labeler)
    queries = load_queries(paths.QUERIES, "test", run.tokenizer.pad_token_id, run.params.evaluate.num_queries)
    started = time.perf_counter()
    gold_base, gold_policy, kl_exact = [], [], []
    for draw in range(args.draws):
        setup = run.evaluation(queries, draw, labeler)  # base and policy on the same stream: paired
        base_set, policy_set = sample_and_score(run.base, setup), sample_and_score(run.policy, setup)
        gold_base.append(base_set.gold)
        gold_policy.append(policy_set.gold)
        kl_exact.append(policy_set.kl_exact.numpy())
    seconds = time.perf_counter() - started
    base_sd = float(np.concatenate(gold_base).std(ddof=1))
    measures = {
        "gold gain (base sigma)": (np.stack(gold_policy, 1) - np.stack(gold_base, 1)) / base_sd,
        "exact KL (nats)": np.stack(kl_exact, 1).astype(float),
    }
    n = len(queries)
    lines = [
        f"# The evaluation's variance, between and within test queries: {args.policy}",
        "",
        f"`.venv/bin/python bench/probe_eval_variance.py --draws {args.draws}` ({seconds:.0f} s; {n} test "
        f"queries, {args.draws} responses each; fp32 2048x2048 matrix product at "
        f"{measured_matmul_flops() / 1e9:.0f} GFLOP/s)",
        "",
        "| measure | mean | var between queries | var within a query | share within | "
        f"SE, {n} x 1 (now) | SE, {n} x 2 | SE, {n} x 4 | SE, {2 * n} x 1 | SE, {4 * n} x 1 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, values in measures.items():
        var_query, var_within = variance_components(values)
        ses = [standard_error(var_query, var_within, q, r) for q, r in ((n, 1), (n, 2), (n, 4), (2 * n, 1), (4 * n, 1))]
        share = var_within / (var_query + var_within)
        lines.append(
            f"| {name} | {values.mean():.3f} | {var_query:.3f} | {var_within:.3f} | {share:.0%} | "
            + " | ".join(f"{se:.3f}" for se in ses)
            + " |"
        )
    emit("\n".join(lines), args.output)


if __name__ == "__main__":
    main()
