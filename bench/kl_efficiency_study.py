"""What buys more gold per nat of KL on the weak shipped seed (issue 50): PPO's step noise.

`bench/results/seed_diagnosis.md` found that the weak seed's gold rises with KL at about 0.13 σ per nat
and that nothing spends the KL budget; the alignment study's ``oracle-reward`` row (PPO scored by the
gold labeler itself) reached only 0.18 σ per nat, so at this budget the reward model is not what limits
gold per nat: PPO spends KL on moves the reward does not ask for. A suspect: the step's noise. Adam takes
steps of about ``lr`` per parameter whatever the gradient's signal-to-noise, so the KL a run spends on
noise grows like steps x lr², the gain like steps x lr x SNR. Each experiment below changes one thing that
lowers the noise per unit of gain, and reruns ``train_policy`` and ``evaluate`` on the shipped reward model:

- ``lr-half-16``: half the step size, twice the updates (the same distance at a quarter of the noise per step);
- ``batch-64``: twice the episodes per update at the same step size and steps (a better gradient per step);
- ``batch-64-epochs-2``: twice the episodes, half the passes over each (the same training compute per update).

The measure is the evaluation's over-optimisation curve (gold against KL at every checkpoint), not the
end point alone: the runs end at different KL.

Usage (see ``bench/experiments.py`` for how experiments run and are timed):

    .venv/bin/python bench/kl_efficiency_study.py --baseline-log run.log \\
        --output bench/results/kl_efficiency_table.md
"""

from __future__ import annotations

from experiments import Experiment, collect, curves, emit, parser, render, run_all, stage_times

VARIANTS = [
    Experiment(
        "lr-half-16",
        {"ppo.lr": "1.25e-4", "ppo.total_episodes": "512", "ppo.checkpoint_every": "4"},
        "half the step size, 16 updates",
    ),
    Experiment("batch-64", {"ppo.batch_size": "64", "ppo.total_episodes": "512"}, "64 episodes an update, 8 updates"),
    Experiment(
        "batch-64-epochs-2",
        {"ppo.batch_size": "64", "ppo.total_episodes": "512", "ppo.ppo_epochs": "2"},
        "64 episodes an update, 2 passes over each, 8 updates",
    ),
]


def main() -> None:
    args = parser(__doc__).parse_args()
    if not args.no_run:
        run_all(VARIANTS)
    baseline_times = stage_times(args.baseline_log.read_text())
    baseline = collect(VARIANTS, baseline_times)
    report = render(VARIANTS, baseline_times, baseline, "default (a weak seed)") + "\n\n" + curves(VARIANTS)
    emit(report, args.output)


if __name__ == "__main__":
    main()
