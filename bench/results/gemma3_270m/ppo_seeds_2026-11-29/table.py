"""Per-update rollout KL, reward-model score and gold of Gemma's train_policy under PPO-only seeds."""
import csv, json, sys
from pathlib import Path
root = Path("/tmp/gemma_seeds")
runs = [("root seed (1)", root / "seed_root")] + [(f"ppo.seed {s}", root / f"seed_{s}") for s in sys.argv[1:]]
def col(d, name):
    with open(d / "plots/metrics/objective" / f"{name}.tsv") as f:
        return [float(r[name]) for r in csv.DictReader(f, delimiter="\t")]
print("| run | " + " | ".join(f"KL after {i}" for i in range(1, 8)) + " | score last quarter | gold last quarter |")
print("|---|" + "---:|" * 9)
for label, d in runs:
    if not d.exists():
        continue
    kl, m = col(d, "kl"), json.loads((d / "metrics.json").read_text())
    pol = json.loads((d / "policy.json").read_text()) if (d / "policy.json").exists() else json.loads(Path("/tmp/gemma3/metrics/policy.json").read_text())
    print(f"| {label} | " + " | ".join(f"{k:.2f}" for k in kl[1:8]) + f" | {pol['score/last_quarter']:.2f} | {pol['gold/last_quarter']:.3f} |")
