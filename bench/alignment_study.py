"""The CPU profile's alignment study: one knob at a time away from the shipped `params.yaml`, run
with `dvc exp` on DVC's cache (see ``bench/experiments.py``), tabulated with pipeline wall time,
reward-model accuracy, gold gain ± paired standard error and KL.

Usage (the default run first, so that its outputs are in the cache and its log gives the times of
the stages an experiment reuses):

    make run 2>&1 | tee run.log
    .venv/bin/python bench/alignment_study.py --baseline-log run.log --output bench/results/alignment_study_table.md
    .venv/bin/dvc exp show --md --only-changed     # DVC's own view of the same experiments
"""

from __future__ import annotations

from experiments import Experiment, collect, emit, parser, render, run_all, stage_times

STUDY = [
    Experiment(
        "oracle-reward",
        {"ppo.score_source": "gold"},
        "PPO scored by the gold labeler itself: what PPO reaches on this budget with a perfect reward",
    ),
    Experiment("ppo-lr-3e-4", {"ppo.lr": "3e-4"}, "a larger PPO step"),
    Experiment("rm-last-token", {"reward.train.pooling": "last"}, "the reference readout"),
    Experiment("labels-512", {"data.preferences.num_labels": "512"}, "half the labels"),
    Experiment(
        "rm-top-6-of-30",
        {"reward.train.num_layers": "null", "reward.train.freeze_layers": "24", "reward.train.lr": "3e-4"},
        "the previous profile's reward model: all 30 blocks, top 6 trainable",
    ),
    Experiment(
        "truncate-at-period",
        {"task.truncate_token": "'.'", "task.truncate_after": "8"},
        "the reference task shape: responses cut after the first '.' from token 8, -1 if none",
    ),
]


def main() -> None:
    args = parser(__doc__).parse_args()
    if not args.no_run:
        run_all(STUDY)
    baseline_times = stage_times(args.baseline_log.read_text())
    baseline = collect(STUDY, baseline_times)
    emit(render(STUDY, baseline_times, baseline, "default"), args.output)


if __name__ == "__main__":
    main()
