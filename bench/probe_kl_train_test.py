"""Probe: is a PPO policy's KL from the base the same on the queries it trained on and on held-out ones?

`ppo.kl.budget` reads the policy's KL on train queries (it must not look at the test split); the
evaluation, and issue 50's "KL <= 6", measure it on the test queries. This samples the shipped policy
(`models/policy`) on every train and every test query, ``--draws`` times each (other random streams),
and prints each split's mean per-response KL (k1, as the evaluation measures it) with its standard error,
and the difference with the standard error of the difference.

Usage (after `dvc repro`, alone on the machine):

    .venv/bin/python bench/probe_kl_train_test.py --draws 2
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import emit, measured_matmul_flops  # noqa: E402
from shipped_run import load_shipped_run, probe_parser  # noqa: E402

from rlhf_pipeline import paths  # noqa: E402
from rlhf_pipeline.evaluation import mean_and_stderr, sample_and_score  # noqa: E402
from rlhf_pipeline.queries import load_queries  # noqa: E402


def main() -> None:
    parser = probe_parser(__doc__, draws=2, draws_help="responses per query (each from its own stream)")
    args = parser.parse_args()
    run = load_shipped_run(args.policy)
    started = time.perf_counter()
    kls = {}
    for split in ("train", "test"):
        queries = load_queries(paths.QUERIES, split, run.tokenizer.pad_token_id)
        per_draw = [sample_and_score(run.policy, run.evaluation(queries, draw)).kl_k1 for draw in range(args.draws)]
        kls[split] = torch.cat(per_draw)
    lines = [
        f"# KL on train and test queries: {args.policy}",
        "",
        f"`.venv/bin/python bench/probe_kl_train_test.py --draws {args.draws}` "
        f"({time.perf_counter() - started:.0f} s; fp32 2048x2048 matrix product at "
        f"{measured_matmul_flops() / 1e9:.0f} GFLOP/s)",
        "",
        "| queries | responses | mean KL (k1) | SE | sd |",
        "|---|---:|---:|---:|---:|",
    ]
    for split, values in kls.items():
        mean, se = mean_and_stderr(values)
        lines.append(f"| {split} | {len(values)} | {mean:.3f} | {se:.3f} | {values.std().item():.3f} |")
    (train, se_train), (test, se_test) = mean_and_stderr(kls["train"]), mean_and_stderr(kls["test"])
    lines += ["", f"train - test: {train - test:+.3f} (SE {math.hypot(se_train, se_test):.3f})"]
    emit("\n".join(lines), args.output)


if __name__ == "__main__":
    main()
