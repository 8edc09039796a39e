"""The table of ``bench/results/gemma3_270m.md`` (2026-11-29, 15:45 UTC): the rollout KL after each update, and
the last quarter's raw score and gold, of Gemma's ``train_policy`` under the root seed and ``ppo.seed`` 2 and 3.

Reads the DVCLive series and ``metrics/policy.json`` copied beside this file (``seed_*/``). Usage:
``python bench/results/gemma3_270m/ppo_seeds_2026-11-29/table.py``
"""

import csv
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = [("root seed (1)", "seed_root"), ("`ppo.seed` 2", "seed_2"), ("`ppo.seed` 3", "seed_3")]


def series(run: Path, name: str) -> list[float]:
    with open(run / f"{name}.tsv") as rows:
        return [float(row[name]) for row in csv.DictReader(rows, delimiter="\t")]


print(
    "| run | "
    + " | ".join(f"after {update}" for update in range(1, 8))
    + " | score, last quarter | gold, last quarter |"
)
print("|---|" + "---:|" * 9)
for label, folder in RUNS:
    run = HERE / folder
    kl, summary = series(run, "kl"), json.loads((run / "policy.json").read_text())
    after = " | ".join(f"{value:.2f}" for value in kl[1:8])  # kl[0]: the base policy's own rollout
    print(f"| {label} | {after} | {summary['score/last_quarter']:.2f} | {summary['gold/last_quarter']:.3f} |")
