"""Probe: does a neighbour process that runs between a process's steps slow its matrix products by evicting
its weights from the last-level cache?

Issue 50: in the reward bench, TRL's matrix products ran at 133 GFLOP/s with its side alone and at 104 with
the two sides' steps in turn, ours at 125 and 119 (bench/results/reward_bench_in_turns_2026-11-30/ at
commit def2191). This
machine's L3 is large (``lscpu``), so a working set that fits in it could stay there from one step to the
next when a process runs alone, and be evicted by the other side's step when the two take turns.

A worker process holds ``--set-mb`` of fp32 weights (1024x1024 matrices) and runs steps of ``x @ W`` over all of
them (``x``: ``--rows`` x 1024). A neighbour process, in turns with it, streams through ``--neighbour-mb``
of memory for the worker's median step alone. For each working-set size the table gives the worker's GFLOP/s (median of
``--steps``) alone and with the neighbour between its steps. If the cache is the mechanism, a working set that
fits in L3 slows with the neighbour and one far larger than L3 does not.

``--reward trl`` (or ``ours``) runs the direct test instead: that side of ``bench/reward_throughput.py``
(its settings: the GGUF default, 8 pairs a step, the portable pin), alone in its own process for ``--steps``
steps, then again with the streaming neighbour between its steps (for ``--neighbour-seconds`` a turn), through
``common.run_in_turns``; the table gives the side's median step alone and beside the neighbour.

Usage (nothing else running; about 3 minutes on 2 cores; ``--reward``: about 8 minutes a side):

    .venv/bin/python bench/probe_llc_neighbour.py --markdown --output bench/results/probe_llc_neighbour.md
    .venv/bin/python bench/probe_llc_neighbour.py --reward trl --steps 8 --markdown
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import reward_throughput
import torch
from common import StepGate, cpu_name, emit_table, prepare, run_in_turns

WIDTH = 1024


def product_worker(gate: StepGate, set_mb: int, rows: int) -> None:
    """A side for common.run_in_turns whose step is ``x @ W`` over ``set_mb`` of 1024x1024 fp32 weights."""
    torch.set_num_threads(2)
    weights = [torch.randn(WIDTH, WIDTH) for _ in range(matrix_count(set_mb))]
    x = torch.randn(rows, WIDTH)
    out = torch.empty(rows, WIDTH)
    gate.begin()  # then step_ended waits for each next turn itself
    while len(gate.seconds) < gate.steps:
        for weight in weights:
            torch.mm(x, weight, out=out)
        gate.step_ended()


def streaming_neighbour(gate: StepGate, neighbour_mb: int, seconds: float) -> None:
    """A side for common.run_in_turns that streams ``neighbour_mb`` of memory for ``seconds`` each turn."""
    torch.set_num_threads(2)
    buffer = torch.ones(neighbour_mb * 2**20 // 4)
    gate.begin()
    while len(gate.seconds) < gate.steps:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            buffer.mul_(1.000001)  # reads and writes every byte: the cache fills with the neighbour's lines
        gate.step_ended()


def matrix_count(set_mb: int) -> int:
    return max(1, set_mb * 2**20 // (WIDTH * WIDTH * 4))


def alone_then_beside(side: dict, steps: int, neighbour_mb: int, seconds: float | None) -> tuple[float, float]:
    """The median seconds of ``side``'s timed steps (one warm-up step dropped) in its own process alone, then
    with the streaming neighbour taking turns with it for ``seconds`` a turn (None: the side's median step)."""
    (name,) = side
    alone, _ = run_in_turns(side, steps + 1)
    alone_step = statistics.median(alone[name].seconds[1:])
    neighbour = {"neighbour": (streaming_neighbour, (neighbour_mb, seconds or alone_step))}
    beside, _ = run_in_turns({**side, **neighbour}, steps + 1, interleaved=True)
    return alone_step, statistics.median(beside[name].seconds[1:])


def reward_side(args) -> list[list[str]]:
    """The reward bench's ``args.reward`` side alone, then with the streaming neighbour between its steps."""
    bench_args = reward_throughput.argument_parser().parse_args([])  # make bench's settings
    _, tokenizer = prepare(bench_args)
    num_pairs = bench_args.batch_pairs * (args.steps + 1)
    data = reward_throughput.make_data(
        tokenizer, num_pairs, bench_args.prompt_tokens, bench_args.response_tokens, bench_args.seed
    )
    trainer = {"ours": reward_throughput.train_ours, "trl": reward_throughput.train_trl}[args.reward]
    side = {args.reward: (trainer, (data, bench_args))}
    medians = alone_then_beside(side, args.steps, args.neighbour_mb, args.neighbour_seconds)
    return [
        [f"{args.reward} reward step (s)", f"{medians[0]:.2f}", f"{medians[1]:.2f}", f"{medians[1] / medians[0]:.2f}x"]
    ]


def l3_line() -> str:
    lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("L3 cache")), "unknown")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sets-mb", type=int, nargs="+", default=[64, 128, 2048])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--neighbour-mb", type=int, default=2048)
    parser.add_argument("--reward", choices=["ours", "trl"], help="the reward bench's side instead of the worker")
    parser.add_argument("--neighbour-seconds", type=float, default=8.0, help="--reward: the neighbour's turn")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--output")
    args = parser.parse_args()
    if args.reward:
        rows = reward_side(args)
        headers = ["side", "alone", f"a neighbour streaming {args.neighbour_mb} MB between steps", "beside / alone"]
        env = [f"CPU: {cpu_name()}, L3 {l3_line()}", f"timed steps: {args.steps} a run (one warm-up dropped)"]
        notes = [f"the neighbour streams for {args.neighbour_seconds} s a turn; medians of the timed steps"]
        emit_table("A neighbour between a reward side's steps", env, headers, rows, notes, args)
        return
    rows = []
    for set_mb in args.sets_mb:
        worker = {"worker": (product_worker, (set_mb, args.rows))}
        gflop = 2 * args.rows * WIDTH * WIDTH * matrix_count(set_mb) / 1e9
        alone, beside = (gflop / seconds for seconds in alone_then_beside(worker, args.steps, args.neighbour_mb, None))
        rows.append([f"{set_mb} MB", f"{alone:.0f}", f"{beside:.0f}", f"{alone / beside:.2f}x"])
    headers = ["worker's weights", "GFLOP/s alone", "GFLOP/s, neighbour between steps", "alone / beside"]
    env = [f"CPU: {cpu_name()}, L3 {l3_line()}", f"x: {args.rows} x {WIDTH}; neighbour streams {args.neighbour_mb} MB"]
    notes = ["each cell the median of the timed steps (one warm-up step dropped); each process 2 torch threads"]
    emit_table("A neighbour between steps", env, headers, rows, notes, args)


if __name__ == "__main__":
    main()
