"""What a stage process pays before and after its work: its imports and the interpreter's exit, with the
garbage collector as the stages run it against the collector left on throughout.

Every stage script starts with ``stages/_interpreter.py``, which turns the collector off while a fresh
process imports torch, transformers and datasets; ``runner.run_stage`` then freezes what was imported
(``gc.freeze``: no later collection walks it, the interpreter's last ones at exit included) and turns the
collector back on. The reference is the same process with ``gc.disable`` made a no-op, so the collector
stays on through the imports and nothing is frozen: the collector as it was before 2636011.

Each stage script runs as ``python stages/<stage>.py --help``: every import the script makes at the
top, ``run_stage`` up to its argument parser, then the exit. No stage body runs, so no project or data is
needed and nothing is written. Both variants run through the same ``runpy`` wrapper, in turns (shipped,
then reference, ``--rounds`` times), one process at a time; the table gives the median wall and CPU
seconds (user + system, from ``wait4``) of each, and the reference's time over the shipped one.

Usage (nothing else running; about 3 minutes on 2 cores):

    .venv/bin/python bench/process_start.py --rounds 5 --markdown --output bench/results/process_start_table.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import cpu_name, emit_table

REPO = Path(__file__).resolve().parents[1]
STAGES = sorted(path.stem for path in (REPO / "stages").glob("[!_]*.py"))

# the stage script as `python stages/<name>.py --help` runs it (its folder first on sys.path), with the
# reference's collector left on when asked
WRAPPER = """
import gc, runpy, sys
script, keep_collector_on = sys.argv[1], sys.argv[2] == "on"
if keep_collector_on:
    gc.disable = lambda: None  # stages/_interpreter.py's call does nothing: the collector stays on
sys.argv = [script, "--help"]
sys.path.insert(0, script.rpartition("/")[0])
runpy.run_path(script, run_name="__main__")
"""


def timed_run(stage: str, collector: str) -> tuple[float, float]:
    """(wall s, CPU s) of one process running stage ``stage``'s script up to its --help and exiting."""
    start = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-c", WRAPPER, f"stages/{stage}.py", collector],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"stages/{stage}.py --help (collector {collector}) failed: {process.stderr.read().decode()}")
    return wall, usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="runs of each variant for each stage (default 5)")
    parser.add_argument("--stages", nargs="+", default=STAGES, choices=STAGES, help="stage scripts (default all)")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--output")
    args = parser.parse_args()

    rows, shipped_total, reference_total = [], 0.0, 0.0
    for stage in args.stages:
        runs = {"shipped": [], "on": []}
        for _ in range(args.rounds):
            for collector in runs:
                runs[collector].append(timed_run(stage, collector))
        shipped = [statistics.median(column) for column in zip(*runs["shipped"])]
        reference = [statistics.median(column) for column in zip(*runs["on"])]
        shipped_total += shipped[1]
        reference_total += reference[1]
        rows.append(
            [
                stage,
                f"{reference[0]:.2f}",
                f"{shipped[0]:.2f}",
                f"{reference[1]:.2f}",
                f"{shipped[1]:.2f}",
                f"{reference[1] / shipped[1]:.2f}x",
            ]
        )
    rows.append(["all stages", "", "", f"{reference_total:.2f}", f"{shipped_total:.2f}", ""])
    headers = [
        "stage script (--help)",
        "wall s, collector on",
        "wall s, as shipped",
        "CPU s, collector on",
        "CPU s, as shipped",
        "CPU ratio",
    ]
    env = [f"CPU: {cpu_name()}, {os.cpu_count()} cores", f"python {sys.version.split()[0]}", f"rounds: {args.rounds}"]
    notes = [
        "collector on: stages/_interpreter.py's gc.disable made a no-op, so the imports run with the collector "
        "on and run_stage freezes nothing (the stages before 2636011)",
        "as shipped: the collector off for the imports, what they made frozen, the collector back on",
        "each cell the median of the rounds; CPU is the child's user + system time; the ratio is the "
        "reference's CPU over the shipped one's",
    ]
    emit_table("Stage process start and exit", env, headers, rows, notes, args)


if __name__ == "__main__":
    main()
