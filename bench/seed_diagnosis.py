"""Why a weaker whole-pipeline seed stops short (issue 50, "diagnose first"): one `dvc exp` per suspect,
on the shipped `params.yaml` whose seed is itself a weak one (+0.56 σ at KL 3.98, under the KL
controller's target of 6). See ``bench/experiments.py`` for how experiments run and are timed.

The suspects, and the probe or ablation that tests each:

- the KL controller (why KL ends near 4, not 6): a probe first, free: `kl_coef` per update in
  ``dvclive/train_policy/plots/metrics/objective/kl_coef.tsv`` (the controller's horizon is in
  episodes: 10,000, the reference's, against a run of 256); then ``kl-init-0.05``, a third of the
  penalty, which is what a working controller would do below its target;
- the number of updates: ``episodes-384``, 12 updates instead of 8 at the same step size;
- the first remedy, after the two above: ``controller-32-384``, a horizon of one update's episodes
  (each update may move the KL coefficient by up to 20 %) and 12 updates;
- the reward model: its held-out accuracy and Spearman correlation with gold on fresh base samples
  are in ``metrics/reward.json`` and ``metrics/evaluate.json`` already (no run needed).

Usage (the default run's log gives the times of the stages an experiment reuses):

    .venv/bin/python bench/seed_diagnosis.py --baseline-log run.log \\
        --output bench/results/seed_diagnosis_table.md
"""

from __future__ import annotations

from experiments import Experiment, collect, emit, parser, render, run_all, stage_times

SUSPECTS = [
    Experiment("kl-init-0.05", {"ppo.kl.init_coef": "0.05"}, "a third of the KL penalty from the first update"),
    Experiment("episodes-384", {"ppo.total_episodes": "384"}, "12 updates instead of 8"),
    Experiment(
        "controller-32-384",
        {"ppo.kl.horizon": "32", "ppo.total_episodes": "384"},
        "the first remedy: a controller that acts (horizon of one update's episodes) and 12 updates",
    ),
]


def main() -> None:
    args = parser(__doc__).parse_args()
    if not args.no_run:
        run_all(SUSPECTS)
    baseline_times = stage_times(args.baseline_log.read_text())
    baseline = collect(SUSPECTS, baseline_times)
    emit(render(SUSPECTS, baseline_times, baseline, "default (a weak seed)"), args.output)


if __name__ == "__main__":
    main()
