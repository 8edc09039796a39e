"""The evaluate stage's outputs: one row per held-out query, the over-optimisation points and plot,
and the Markdown report, each written atomically into the evaluation folder."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from rlhf_pipeline.evaluation import SampleSet, overoptimization_plot
from rlhf_pipeline.io import atomic_file, write_json
from rlhf_pipeline.metric_keys import RESPONSES_PER_QUERY
from rlhf_pipeline.ppo.checkpoint import snapshot_name

PLOT = "overoptimization.png"


def sample_rows(query_texts: list[str], base_set: SampleSet, policy_set: SampleSet) -> list[dict]:
    """One row per response pair: the query's text, the base's and the policy's response and scores, the KL
    (``ppo.kl.estimator``'s and the exact one); a query answered k times (``evaluate.responses_per_query``)
    has k rows in a row. Every query, not a sample of them: the promotion gate pairs versions on these (rlhf
    models gate)."""

    def gold(sample_set: SampleSet, i: int) -> float | None:
        return None if sample_set.gold is None else round(float(sample_set.gold[i]), 4)

    k = policy_set.responses_per_query
    return [
        {
            "query": query_texts[i // k],
            "base_response": base_set.texts[i],
            "policy_response": policy_set.texts[i],
            "base_proxy": round(base_set.proxy[i].item(), 4),
            "policy_proxy": round(policy_set.proxy[i].item(), 4),
            "base_gold": gold(base_set, i),
            "policy_gold": gold(policy_set, i),
            "kl": round(policy_set.kl[i].item(), 4),
            "kl_exact": round(policy_set.kl_exact[i].item(), 4),
        }
        for i in range(len(query_texts) * k)
    ]


def best_point(points: list[dict]) -> dict:
    """The curve point with the best gold score, or the best proxy score where there is no gold: as
    improvements over the base on the point's own queries where every point has one (a checkpoint
    sampled on fewer queries than the shipped policy, ``evaluate.curve_queries``, has a raw mean over
    other queries), else as raw means."""
    score = "gold" if all(p["gold"] is not None for p in points) else "proxy"
    if all(p.get(f"{score}_std_units") is not None for p in points):
        return max(points, key=lambda p: p[f"{score}_std_units"])
    return max(points, key=lambda p: p[score])


def write_evaluation(
    out: str | Path, rows: list[dict], points: list[dict], metrics: dict, table_rows: int, shipped_update: int | None
) -> None:
    """Write ``out``/responses.jsonl (every row), samples.csv and samples.json (the first
    ``table_rows``, without the KLs), overoptimization.json and .png, and report.md."""
    out = Path(out)
    with atomic_file(out / "responses.jsonl", "w") as handle:
        handle.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    table = [{k: v for k, v in row.items() if k not in ("kl", "kl_exact")} for row in rows[:table_rows]]
    with atomic_file(out / "samples.csv", "w") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    write_json(out / "samples.json", table)
    write_json(out / "overoptimization.json", points)
    overoptimization_plot(points, out / PLOT, shipped_update)
    with atomic_file(out / "report.md") as handle:
        handle.write(render_report(metrics, points, best_point(points), table))


def _fmt(value) -> str:
    if isinstance(value, str):  # a reason, e.g. why an improvement is undefined
        return value
    return "n/a" if value is None else f"{value:.3f}"


def _with_error(point: dict, key: str) -> str:
    if point.get(f"{key}_std_units") is None:
        return "n/a"
    return f"{point[f'{key}_std_units']:+.3f} +- {point[f'{key}_stderr']:.3f}"


def _exact_kl(point: dict) -> str:
    if point.get("kl_exact") is None:  # a curve written before the exact KL was measured
        return "n/a"
    return f"{point['kl_exact']:.3f} +- {point['kl_exact_stderr']:.3f}"


def render_report(metrics: dict, points: list[dict], best: dict, rows: list[dict]) -> str:
    lines = [
        "# Evaluation report",
        "",
        f"Held-out test queries: {metrics['queries']}, {metrics.get(RESPONSES_PER_QUERY, 1)} response(s) to each "
        "from each model. Base and policy sampled with the same seed; standard errors are over queries.",
        "",
        "| metric | value |",
        "|---|---|",
    ]
    for key, value in metrics.items():
        if not isinstance(value, dict) and key not in ("queries", RESPONSES_PER_QUERY):
            lines.append(f"| `{key}` | {_fmt(value)} |")
    lines += [
        "",
        "## Reward over-optimisation",
        "",
        f"![over-optimisation curve]({PLOT})",
        "",
        "Improvements are over the base model on the same queries, in base-std units, +- one paired standard error.",
        "KL is `ppo.kl.estimator`'s; exact KL sums each token's KL over the whole vocabulary (+- its standard error).",
        "",
        "| update | KL | exact KL | proxy | gold | proxy improvement | gold improvement | queries |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {p['update']} | {p['kl']:.3f} | {_exact_kl(p)} | {p['proxy']:.3f} | {_fmt(p['gold'])} | "
        f"{_with_error(p, 'proxy')} | {_with_error(p, 'gold')} | {p.get('queries', metrics['queries'])} |"
        for p in points
    ]
    criterion = "gold" if best["gold"] is not None else "proxy"
    scores = f"(proxy {best['proxy']:.3f}, gold {_fmt(best['gold'])}, KL {best['kl']:.3f})"
    if best["update"]:
        verdict = (
            f"Best checkpoint by {criterion} score: **update {best['update']}** {scores}; "
            f"its weights are `checkpoints/policy/snapshots/{snapshot_name(best['update'])}`."
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
