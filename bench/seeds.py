"""The shipped configuration over several seeds, with `dvc exp` (see ``bench/experiments.py``).

`seed` is declared by every stage that draws random numbers, so a seed experiment reruns the
whole pipeline: new corpus, queries, labels, reward model and policy. The workspace (the default
run, `params.yaml`'s seed) is the first row; each other seed is one experiment.

Usage:

    make run 2>&1 | tee run.log
    .venv/bin/python bench/seeds.py --baseline-log run.log --seeds 2 3 --output bench/results/seeds.md

``--set KEY=VALUE`` (repeatable) gives every seed's experiment these params too: a candidate default
over several seeds (include the default's own seed in ``--seeds`` then, since the workspace row is the
shipped default, not the candidate).
"""

from __future__ import annotations

from pathlib import Path

from common import measured_matmul_flops
from experiments import (
    METRICS,
    Experiment,
    collect,
    emit,
    experiment_logs,
    logged_metrics,
    parser,
    render,
    run_all,
    seed_summary,
    stage_times,
)


def seed_experiments(seeds: list[int], label: str, sets: list[str]) -> list[Experiment]:
    """One experiment a seed, named ``seed-N-LABEL``, with ``seed=N`` and the ``KEY=VALUE`` params of ``sets``."""
    overrides = {}
    for item in sets:
        key, equals, value = item.partition("=")
        if not equals or not key or key == "seed":
            raise SystemExit(f"--set {item!r}: give KEY=VALUE, a params.yaml key other than seed (--seeds sets it)")
        overrides[key] = value
    suffix = f"-{label}" if label else ""
    return [Experiment(f"seed-{seed}{suffix}", {"seed": str(seed), **overrides}) for seed in seeds]


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--seeds", type=int, nargs="+", default=[2, 3], help="seeds other than params.yaml's")
    p.add_argument("--label", default="", help="appended to each experiment's name (seed-2-LABEL): a new study")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a param every seed's experiment also sets (repeatable): a candidate default over the seeds",
    )
    p.add_argument(
        "--earlier-logs",
        type=Path,
        nargs="*",
        default=[],
        help="the `dvc repro` logs, oldest first, of the runs that made the stages the baseline run reused "
        "(its log has no time for them)",
    )
    p.add_argument(
        "--run-logs",
        type=Path,
        nargs="*",
        default=[],
        help="the output of seed experiments run outside the queue (`dvc exp run --temp -n seed-N-LABEL ... > log`): "
        "their stage times come from these instead of `dvc queue logs`",
    )
    p.add_argument(
        "--from-logs",
        action="store_true",
        help="with --no-run: read every metric from the logs (--baseline-log, --run-logs) instead of `dvc exp show`, "
        "for experiments run in a clone that is gone (the label ceiling is not in a log: n/a)",
    )
    args = p.parse_args()
    if args.from_logs and not args.no_run:
        p.error("--from-logs reads finished runs' logs: pass --no-run too")
    runs = seed_experiments(args.seeds, args.label, args.sets)
    # how fast this machine is today: its speed has varied 2x from day to day, and the wall times with it
    rates = [measured_matmul_flops() / 1e9]
    if not args.no_run:
        run_all(runs)
        rates.append(measured_matmul_flops() / 1e9)
    baseline_times = {}
    for log in [*args.earlier_logs, args.baseline_log]:  # the last run of each stage wins
        baseline_times |= stage_times(log.read_text())
    baseline = collect(runs, baseline_times, experiment_logs(args.run_logs), from_logs=args.from_logs)
    if args.from_logs:
        baseline = logged_metrics(args.baseline_log.read_text(errors="replace"), str(args.baseline_log))
    table = render(runs, baseline_times, baseline, "default seed")
    everyone = [run.metrics for run in runs]
    minutes = [sum(run.stage_seconds.values()) for run in runs]
    if args.sets:  # a candidate is summarised over its own runs: the workspace row is the shipped default, not it
        heading = f"Over the candidate's {len(runs)} seeds (the shipped default's row left out), mean (sd):"
    else:
        everyone.insert(0, baseline)
        minutes.insert(0, sum(baseline_times.values()))
        heading = f"Over {len(everyone)} seeds, mean (sd):"
    summary = [heading, ""]
    summary += [f"- {column}: {seed_summary([m[column] for m in everyone])}" for column in METRICS]
    summary.append(f"- pipeline wall time (s): {seed_summary([float(m) for m in minutes])}")
    summary.append(
        "- this machine's fp32 2048x2048 matrix product, "
        + " and ".join(f"{rate:.0f}" for rate in rates)
        + (" GFLOP/s before and after the runs" if len(rates) > 1 else " GFLOP/s (measured now; nothing was run)")
    )
    emit(table + "\n\n" + "\n".join(summary), args.output)


if __name__ == "__main__":
    main()
