"""Where a process's memory goes while a benchmark runs: every ``allocator.CHECK_SECONDS`` a thread reads
``RssAnon``, malloc's bytes in use and its heap (``mallinfo2``), the minor page faults so far and the
bound's give-backs, under the shipped malloc settings (``--unbounded``: the bound lifted, to see what the
process would keep). The table sums them over windows of ``--window`` seconds; ``--json`` keeps every
reading.

It showed why PPO with a separate value model faults 4.1 M pages an update under the bound
(``bench/results/allocator.md``, 2026-11-30): its heap holds 3 to 4 GB of holes that its phases fill in turn,
and the bound gives them back each time ``RssAnon`` climbs past what its last give-back left.

Usage (nothing else running), any benchmark and its arguments after ``--``:

    .venv/bin/python bench/probe_malloc_trace.py --markdown --output trace.md -- \
        bench/ppo_throughput.py --only separate --updates 2
"""

from __future__ import annotations

import argparse
import json
import resource
import runpy
import sys
import threading
import time

from common import emit_table

from rlhf_pipeline import allocator


def record(trace: list[tuple], seconds: float) -> None:
    libc = allocator.glibc()
    start = time.perf_counter()
    while True:
        time.sleep(seconds)
        info = libc.mallinfo2()
        trace.append(
            (
                time.perf_counter() - start,
                allocator.resident_anonymous_bytes() or 0,
                info.uordblks + info.hblkhd,
                allocator.heap_bytes(info),
                resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
                allocator.times_given_back() or 0,
            )
        )


def gb_range(rows: list, column: int) -> str:
    return f"{min(r[column] for r in rows) / 1e9:.2f} to {max(r[column] for r in rows) / 1e9:.2f}"


def windows(trace: list[tuple], seconds: float) -> list[list[str]]:
    """One row per window: its start, RssAnon, in use and heap (GB, lowest to highest), faults in it, and
    the give-backs so far."""
    rows, start = [], 0
    while start < len(trace):
        end = start
        while end < len(trace) and trace[end][0] < trace[start][0] + seconds:
            end += 1
        part = trace[start:end]
        faults = part[-1][4] - (trace[start - 1][4] if start else part[0][4])
        ranges = [gb_range(part, column) for column in (1, 2, 3)]
        rows.append([f"{part[0][0]:.0f}", *ranges, f"{faults:,}", str(part[-1][5])])
        start = end
    return rows


def run_traced(bench: list[str], unbounded: bool, parser) -> list[tuple]:
    """The benchmark run in this process, as its script runs, with :func:`record` beside it; the readings."""
    if not bench:
        parser.error("name a benchmark after --, e.g. -- bench/ppo_throughput.py --only separate")
    if allocator.glibc() is None:
        sys.exit("probe_malloc_trace: this C library is not glibc 2.33 or later: there is no mallinfo2 to read")
    if unbounded:
        allocator.KEPT_BOUND = 1 << 40  # before the benchmark's prepare() starts the bound's thread
    trace: list[tuple] = []
    threading.Thread(target=record, args=(trace, allocator.CHECK_SECONDS), daemon=True).start()
    own = sys.argv
    sys.argv = bench
    try:
        runpy.run_path(bench[0], run_name="__main__")
    finally:
        sys.argv = own  # this report's command line is this script's
    return list(trace)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=float, default=8.0, help="seconds summed into one row of the table")
    parser.add_argument("--unbounded", action="store_true", help="lift the bound (allocator.KEPT_BOUND = 1 TiB)")
    parser.add_argument("--json", help="write every reading here")
    parser.add_argument("--from-json", help="no benchmark: the table of readings an earlier --json wrote")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--output")
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="-- then the benchmark's script and arguments")
    args = parser.parse_args(argv)
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if args.from_json:
        with open(args.from_json) as saved:
            readings = json.load(saved)
    else:
        readings = run_traced(bench, args.unbounded, parser)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(readings, out)
    notes = [
        f"readings: `{args.from_json}`"
        if args.from_json
        else f"benchmark: `{' '.join(bench)}`; bound {'lifted' if args.unbounded else 'as shipped'}",
        "in use: malloc's `uordblks + hblkhd`; heap: `arena + hblkhd` (what malloc holds from the OS, in use or "
        "free); RssAnon: the process's resident anonymous memory",
    ]
    headers = ["s", "RssAnon GB", "in use GB", "heap GB", "minor faults", "given back so far"]
    env = [f"readings every {allocator.CHECK_SECONDS} s"]
    emit_table("Malloc trace", env, headers, windows(readings, args.window), notes, args)


if __name__ == "__main__":
    main()
