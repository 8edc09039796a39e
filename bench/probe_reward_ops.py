"""Where each side's reward-model step goes, op by op, without torch's profiler (issue 50, point 4).

``bench/reward_throughput.py --profile`` reads one step under torch's profiler, whose own cost on the AMD
EPYC made up most of its "other" column (``results/reward_speed_profile.md``). Here each aten op of a step is
timed by ``common.OpTimeProfile`` instead (two clock reads around the op, nothing recorded inside it). The
sides run as the bench's sequential order runs them (``common.run_in_turns``: each in its own process, ours
and then TRL's), on the bench's workload and settings (``reward_throughput.argument_parser``'s defaults: 8
pairs a step, prompt 64 + 2 x 24 tokens, the portable pin, the shipped allocator). Steps 1 and 2 run untimed
(allocation, Adam's state); ``--steps`` more are timed op by op and averaged.

The table groups the ops as the bench's profile does (``common.op_group``): the matrix products (with the
rate torch's FLOP formulas for them imply), attention forward and backward, the optimizer step (Adam, and
TRL's gradient clipping), and the rest, with its six largest ops. The ratio
``TRL / ours`` of the ops' total is the work ratio a step would show if the host's speed held still over
both sides' turns; the bench's measured ratio can be compared with it.

Usage (nothing else running; about 3 minutes on 2 cores):

    .venv/bin/python bench/probe_reward_ops.py --markdown --output bench/results/<dir>/reward_ops.md
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import reward_throughput  # noqa: E402
from common import (  # noqa: E402
    GROUP_NAMES,
    OpTimeProfile,
    cpu_name,
    emit_table,
    measured_matmul_flops,
    prepare,
    run_in_turns,
)

UNTIMED = 2  # steps run before the timed ones: allocation, Adam's state


def ratio_row(label: str, ours: float, trl: float) -> list[str]:
    """One line of the table: seconds a step on each side and TRL's over ours."""
    return [label, f"{ours:.3f}", f"{trl:.3f}", f"{trl / ours:.2f}" if ours else "-"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help=f"steps timed op by op, after {UNTIMED} untimed ones")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--output")
    args = parser.parse_args()

    bench = reward_throughput.argument_parser().parse_args([])
    _, tokenizer = prepare(bench)
    steps = UNTIMED + args.steps
    data = reward_throughput.make_data(
        tokenizer, bench.batch_pairs * steps, bench.prompt_tokens, bench.response_tokens, bench.seed
    )
    env = [f"device: CPU ({cpu_name()}), 2 threads; 2048x2048 fp32 product {measured_matmul_flops() / 1e9:.0f} GFLOP/s"]
    measured, _ = run_in_turns(
        {"ours": (reward_throughput.train_ours, (data, bench)), "trl": (reward_throughput.train_trl, (data, bench))},
        steps=steps,
        profile_step=UNTIMED + 1,
        profile_steps=args.steps,
        profile_kind=OpTimeProfile,
    )
    ours, trl = measured["ours"].profile, measured["trl"].profile

    rows = []
    for group in GROUP_NAMES:
        label = group
        if group == "matrix products":
            rates = (profile.matmul_flops / profile.seconds[group] / 1e9 for profile in (ours, trl))
            label += " (GFLOP/s ours, TRL: {:.0f}, {:.0f})".format(*rates)
        rows.append(ratio_row(label, ours.seconds[group], trl.seconds[group]))
    other = {"ours": ours.other_seconds, "trl": trl.other_seconds}
    for op, _ in (collections.Counter(other["ours"]) + collections.Counter(other["trl"])).most_common(6):
        rows.append(ratio_row(f"other: {op}", other["ours"].get(op, 0.0), other["trl"].get(op, 0.0)))
    rows.append(ratio_row("all ops", sum(ours.seconds.values()), sum(trl.seconds.values())))
    rows.append(ratio_row("step's wall, timed steps' mean", ours.wall, trl.wall))

    timed = {side: measured[side].seconds[UNTIMED:] for side in measured}
    notes = [
        f"{args.steps} steps a side timed op by op after {UNTIMED} untimed; seconds are means a step",
        f"matrix products: {ours.matmul_flops / 1e9:.0f} GFLOP a step ours, {trl.matmul_flops / 1e9:.0f} TRL's: "
        f"the FLOP bound {trl.matmul_flops / ours.matmul_flops:.2f}x",
        "each step's wall (s): ours "
        + ", ".join(f"{w:.2f}" for w in timed["ours"])
        + "; TRL "
        + ", ".join(f"{w:.2f}" for w in timed["trl"]),
        "the wall includes the timer's own cost (two clock reads an op, about 3,500 ops a step) and Python's",
    ]
    emit_table(
        "Reward step, op by op: ours and TRL 1.12's", env, ["ops", "ours s", "TRL s", "TRL / ours"], rows, notes, args
    )


if __name__ == "__main__":
    main()
