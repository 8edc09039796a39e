"""The training core's variants on the CPU default: the advantage estimator (gae, rloo, grpo) and
full fine-tune against LoRA, each over three PPO seeds, run with `dvc exp` (``bench/experiments.py``).

Every variant changes `ppo.*` only, so an experiment reruns `train_policy` and `evaluate` on the
default run's reward model, and the evaluation samples the same held-out queries with the same
random stream: per seed, the variants are paired. `ppo.seed` varies PPO's own random streams (episode
order, sampling, minibatches); seed 1 is the root seed, i.e. the shipped run itself for gae + full.

The critic-free estimators draw `ppo.samples_per_query` = 4 responses per query (8 queries of 4 in a
batch of 32 episodes: the same episodes per update as the default). LoRA: rank 16, alpha 32, every
linear layer of the trainable top 6 blocks, with the learning rate `--lora-lr` (LoRA moves less per
step than a full fine-tune: the study's LoRA rows use the rate that reached the default's KL
budget on seed 1, see the lab notes).

Columns: gold gain ± paired SE (base σ, 293 held-out queries), KL (evaluation, k1), the wall time of
train_policy + evaluate and train_policy's peak RSS, both from the stages' own log lines.

Usage (after the default run, whose outputs must be in DVC's cache and whose log gives the
shipped row's times):

    make run 2>&1 | tee run.log
    .venv/bin/python bench/estimator_study.py --baseline-log run.log --output bench/results/estimator_study.md
    .venv/bin/dvc exp show --md --only-changed     # DVC's own view of the same experiments
"""

from __future__ import annotations

import re
import statistics

from experiments import METRICS, Experiment, dvc, emit, existing_experiments, exp_rows, fmt, metric, parser, run_all

SEEDS = (1, 2, 3)
ESTIMATORS = {
    "gae": {},
    "rloo": {"ppo.advantage": "rloo", "ppo.samples_per_query": "4"},
    "grpo": {"ppo.advantage": "grpo", "ppo.samples_per_query": "4"},
}
LORA = "{rank:16,alpha:32.0,dropout:0.0,target_modules:all-linear}"
STAGE_LINE = re.compile(r"^stage (\w+): done in (\d+) s, peak RSS (\d+) MB", re.MULTILINE)


def variants(lora_lr: str) -> dict[str, dict[str, str]]:
    lora = {"ppo.lora": LORA, "ppo.lr": lora_lr}
    return {
        f"{name}-{tune}": {**overrides, **(lora if tune == "lora" else {})}
        for name, overrides in ESTIMATORS.items()
        for tune in ("full", "lora")
    }


def experiments(lora_lr: str) -> dict[tuple[str, int], Experiment]:
    """Every (variant, seed) but the shipped run (gae-full, seed 1), which is the workspace."""
    found = {}
    for variant, overrides in variants(lora_lr).items():
        for seed in SEEDS:
            if (variant, seed) == ("gae-full", 1):
                continue
            seeded = {**overrides, **({"ppo.seed": str(seed)} if seed != 1 else {})}
            found[variant, seed] = Experiment(f"{variant}-s{seed}", seeded)
    return found


def stage_lines(log: str) -> dict[str, tuple[int, int]]:
    return {name: (int(seconds), int(rss)) for name, seconds, rss in STAGE_LINE.findall(log)}


def result(row: dict, log: str) -> dict[str, float | None]:
    stages = stage_lines(log)
    seconds = sum(stages[s][0] for s in ("train_policy", "evaluate") if s in stages)
    return {
        "gain": metric(row, METRICS["gold gain (base σ)"]),
        "se": metric(row, METRICS["± SE"]),
        "kl": metric(row, METRICS["KL"]),
        "seconds": float(seconds) if stages else None,
        "rss": float(stages["train_policy"][1]) if "train_policy" in stages else None,
    }


def summary(values: list[float | None], digits: int = 3) -> str:
    present = [v for v in values if v is not None]
    if len(present) < 2:
        return fmt(present[0], digits) if present else "n/a"
    return f"{statistics.mean(present):.{digits}f} (sd {statistics.stdev(present):.{digits}f})"


def render(results: dict[tuple[str, int], dict], lora_lr: str) -> str:
    lines = [
        "| variant | seed | gold gain ± paired SE (base σ) | KL | train_policy + evaluate | peak RSS (train_policy) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for (variant, seed), r in sorted(
        results.items(), key=lambda item: (list(variants(lora_lr)).index(item[0][0]), item[0][1])
    ):
        minutes = "n/a" if r["seconds"] is None else f"{int(r['seconds']) // 60}:{int(r['seconds']) % 60:02d}"
        rss = "n/a" if r["rss"] is None else f"{r['rss'] / 1024:.2f} GB"
        lines.append(
            f"| {variant} | {seed} | {fmt(r['gain'])} ± {fmt(r['se'])} | {fmt(r['kl'], 2)} | {minutes} | {rss} |"
        )
    lines += ["", "Per variant, over the three seeds, mean (sd):", ""]
    lines += [
        "| variant | gold gain | KL | seconds | peak RSS (MB) | better than gae-full on every seed |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for variant in variants(lora_lr):
        rows = [results[variant, seed] for seed in SEEDS]
        shipped = [results["gae-full", seed] for seed in SEEDS]
        better = all(
            r["gain"] is not None and s["gain"] is not None and r["gain"] > s["gain"] for r, s in zip(rows, shipped)
        )
        lines.append(
            f"| {variant} | {summary([r['gain'] for r in rows])} | {summary([r['kl'] for r in rows], 2)} | "
            f"{summary([r['seconds'] for r in rows], 0)} | {summary([r['rss'] for r in rows], 0)} | "
            f"{'yes' if better else 'no'} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--lora-lr", default="2.5e-3", help="ppo.lr of the LoRA variants")
    args = p.parse_args()
    planned = experiments(args.lora_lr)
    if not args.no_run:
        run_all(list(planned.values()))
    rows = existing_experiments()
    workspace = next(row for row in exp_rows() if row.get("rev") == "workspace")
    results = {("gae-full", 1): result(workspace, args.baseline_log.read_text())}
    for key, experiment in planned.items():
        if experiment.name not in rows:
            raise SystemExit(f"experiment {experiment.name!r} has no result: see `dvc queue logs {experiment.name}`")
        results[key] = result(rows[experiment.name], dvc("queue", "logs", experiment.name, capture=True))
    emit(render(results, args.lora_lr), args.output)


if __name__ == "__main__":
    main()
