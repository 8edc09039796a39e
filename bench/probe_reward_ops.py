"""Where each side's reward-model step goes, op by op, without torch's profiler (issue 50, point 4).

``bench/reward_throughput.py --profile`` reads one step under torch's profiler, whose own cost on the AMD
EPYC made up most of its "other" column (``results/reward_speed_profile.md``). Here each aten op of a step is
timed by a ``TorchDispatchMode`` instead (two clock reads around the op, nothing recorded inside it), in
each side's own process, on the bench's workload and settings (``reward_throughput.argument_parser``'s
defaults: 8 pairs a step, prompt 64 + 2 x 24 tokens, the portable pin, the shipped allocator). Steps 1 and 2
run untimed (allocation, Adam's state); ``--steps`` more are timed op by op and averaged.

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
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import GROUP_NAMES, cpu_name, emit_table, measured_matmul_flops, op_group  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils.flop_counter import flop_registry  # noqa: E402


class OpTimes(TorchDispatchMode):
    """Seconds and calls per aten op, and the matrix products' FLOPs (torch's own formulas), while ``on``."""

    def __init__(self):
        super().__init__()
        self.on = False
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.product_flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.on:
            return func(*args, **(kwargs or {}))
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        name = f"aten::{func.overloadpacket.__name__}"
        self.seconds[name] += time.perf_counter() - start
        self.calls[name] += 1
        if op_group(name) == "matrix products":
            self.product_flops += flop_registry[func.overloadpacket](*args, **(kwargs or {}), out_val=out)
        return out


class Gate:
    """The bench's ``StepGate`` as one process needs it: the first ``untimed`` steps run with the timer off."""

    def __init__(self, timer: OpTimes, untimed: int, steps: int):
        self.timer, self.untimed, self.steps = timer, untimed, untimed + steps
        self.walls: list[float] = []
        self._start = 0.0

    def begin(self) -> None:
        self._start = time.perf_counter()

    restart_clock = begin

    def step_ended(self) -> None:
        self.walls.append(time.perf_counter() - self._start)
        self.timer.on = len(self.walls) >= self.untimed
        self._start = time.perf_counter()


def grouped(seconds: dict[str, float]) -> dict[str, float]:
    """Seconds per group of ``common.OP_GROUPS`` (the bench's profile's groups), every group present."""
    groups = dict.fromkeys(GROUP_NAMES, 0.0)
    for name, value in seconds.items():
        groups[op_group(name)] += value
    return groups


def run_side(side: str, steps: int) -> dict:
    """One side's steps in this process: the mean seconds per op over the timed steps, and each step's wall."""
    import reward_throughput

    untimed = 2
    args = reward_throughput.argument_parser().parse_args(["--steps", str(untimed + steps - 1)])
    timer = OpTimes()
    gate = Gate(timer, untimed, steps)
    _, tokenizer = reward_throughput.prepare(args)
    data = reward_throughput.make_data(
        tokenizer, args.batch_pairs * gate.steps, args.prompt_tokens, args.response_tokens, args.seed
    )
    with timer:
        (reward_throughput.train_ours if side == "ours" else reward_throughput.train_trl)(gate, data, args)
    return {
        "seconds": {name: value / steps for name, value in timer.seconds.items()},
        "product_flops": timer.product_flops / steps,
        "walls": gate.walls[untimed:],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="steps timed op by op, after 2 untimed ones")
    parser.add_argument("--side", choices=["ours", "trl"], help=argparse.SUPPRESS)  # a child's side
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--output")
    args = parser.parse_args()
    if args.side:
        print(json.dumps(run_side(args.side, args.steps)))
        return
    env = [f"device: CPU ({cpu_name()}), 2 threads; 2048x2048 fp32 product {measured_matmul_flops() / 1e9:.0f} GFLOP/s"]
    sides = {}
    for side in ("ours", "trl"):  # each in its own process, one after the other, as the bench's sequential order
        command = [sys.executable, __file__, "--side", side, "--steps", str(args.steps)]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        sides[side] = json.loads(done.stdout.strip().splitlines()[-1])
    groups = {side: grouped(result["seconds"]) for side, result in sides.items()}
    rows = []
    for name in GROUP_NAMES:
        ours, trl = groups["ours"][name], groups["trl"][name]
        if name == "matrix products":
            name += " (GFLOP/s ours, TRL: " + ", ".join(
                f"{sides[side]['product_flops'] / groups[side][name] / 1e9:.0f}" for side in ("ours", "trl")
            )
            name += ")"
        rows.append([name, f"{ours:.3f}", f"{trl:.3f}", f"{trl / ours:.2f}" if ours else "-"])
    other = {name for side in sides for name in sides[side]["seconds"] if op_group(name) == "other"}
    seconds = {side: collections.Counter(sides[side]["seconds"]) for side in sides}
    for name in sorted(other, key=lambda name: -(seconds["ours"][name] + seconds["trl"][name]))[:6]:
        ours, trl = seconds["ours"][name], seconds["trl"][name]
        rows.append([f"other: {name}", f"{ours:.3f}", f"{trl:.3f}", f"{trl / ours:.2f}" if ours else "-"])
    totals = {side: sum(groups[side].values()) for side in sides}
    walls = {side: sum(sides[side]["walls"]) / len(sides[side]["walls"]) for side in sides}
    rows.append(["all ops", f"{totals['ours']:.3f}", f"{totals['trl']:.3f}", f"{totals['trl'] / totals['ours']:.2f}"])
    rows.append(
        [
            "step's wall, timed steps' mean",
            f"{walls['ours']:.3f}",
            f"{walls['trl']:.3f}",
            f"{walls['trl'] / walls['ours']:.2f}",
        ]
    )
    flops = {side: sides[side]["product_flops"] / 1e9 for side in sides}
    notes = [
        f"{args.steps} steps a side timed op by op after 2 untimed; seconds are means a step",
        f"matrix products: {flops['ours']:.0f} GFLOP a step ours, {flops['trl']:.0f} TRL's: the FLOP bound "
        f"{flops['trl'] / flops['ours']:.2f}x",
        "each step's wall (s): ours "
        + ", ".join(f"{w:.2f}" for w in sides["ours"]["walls"])
        + "; TRL "
        + ", ".join(f"{w:.2f}" for w in sides["trl"]["walls"]),
        "the wall includes the timer's own cost (two clock reads an op, about 3,500 ops a step) and Python's",
    ]
    emit_table(
        "Reward step, op by op: ours and TRL 1.12's", env, ["ops", "ours s", "TRL s", "TRL / ours"], rows, notes, args
    )


if __name__ == "__main__":
    main()
