"""What the bound on kept memory costs: one check (``allocator.give_back_beyond``) on a fragmented heap, and
every check the bounding thread makes in real stages of the default run.

The thread that bounds what malloc keeps (``rlhf_pipeline/allocator.py``) wakes every
``allocator.CHECK_SECONDS`` (0.25 s) and reads ``RssAnon`` from ``/proc/self/status``. Only when that
passes the bound, and (since 2026-11-30) has grown since the last check, does it call glibc's
``mallinfo2``, which walks every free chunk of
every arena under that arena's lock: such a check costs what the heap's fragmentation makes it cost, and
a thread that allocates meanwhile waits for it. With ``RLHF_MALLOC=keep``:

- **one check**: a child process builds a fragmented heap (``--blocks`` tensors of 256 B to 1 MiB,
  log-uniform, every other one freed) and times a ``/proc`` read, ``mallinfo2``, ``kept_bytes`` and a
  check within the bound, the median of 200 calls each;
- **stages** (``--stages evaluate``): each named stage of the default run runs as its
  script does under ``dvc repro``, with a thread that times the bounding thread's own call once a second
  (``give_back_beyond`` at ``KEPT_BOUND``, which walks whenever ``RssAnon`` is over the bound: an upper
  bound on the thread's cost, which also skips checks that find ``RssAnon`` no higher than the last) and
  counts the heap's free chunks and the checks made while ``RssAnon`` was over the bound; the table
  gives the times and what checking at the shipped rate costs over the stage. The stage rewrites its
  outputs, so they must be up to date first (``dvc status``); the script puts them back from DVC's cache
  after (``dvc checkout --force <stage>``). ``train_policy`` resumes from its persisted checkpoint instead
  of training, so it is refused.

Usage (nothing else running; about 5 minutes on 2 cores):

    .venv/bin/python bench/allocator_check_cost.py --stages evaluate --markdown \
        --output bench/results/allocator_check_cost.md
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import yaml
from common import cpu_name, emit, measured_matmul_flops, render_report, render_table

from rlhf_pipeline.allocator import CHECK_SECONDS, KEPT_BOUND

REPO = Path(__file__).resolve().parents[1]

ONE_CHECK = """
import json, random, statistics, sys, time
from rlhf_pipeline import allocator
allocator.CHECK_SECONDS = 3600  # the thread must not check while this one is timed
assert allocator.keep_freed_memory()
import torch
libc = allocator.glibc()
rng = random.Random(0)
# sizes log-uniform from 256 B to 1 MiB: about 2.5 GB written in all
blocks = [torch.empty(int(2 ** rng.uniform(6, 18)), dtype=torch.float32) for _ in range(int(sys.argv[1]))]
for block in blocks:
    block.fill_(1.0)
del blocks[::2]  # holes all over the heap: the free chunks mallinfo2 walks

def median_us(call, times=200):
    spent = []
    for _ in range(times):
        start = time.perf_counter()
        call()
        spent.append(time.perf_counter() - start)
    return statistics.median(spent) * 1e6

info = libc.mallinfo2()
print(json.dumps({
    "proc": median_us(allocator.resident_anonymous_bytes),
    "mallinfo2": median_us(libc.mallinfo2),
    "kept_bytes": median_us(lambda: allocator.kept_bytes(libc)),
    "within": median_us(lambda: allocator.give_back_beyond(libc, 1 << 40)),  # RssAnon under 1 TiB: no walk
    "free_chunks": info.ordblks + info.smblks,
    "heap_mb": info.arena / 1e6,
}))
"""

STAGE = """
import atexit, json, runpy, sys, threading, time
sys.path.insert(0, "stages")  # the stage's own first import, ``_interpreter``, sits beside it
from rlhf_pipeline import allocator
stage, samples = sys.argv[1], []

def watch():  # the bounding thread's own call, timed once a second while the stage runs
    libc = allocator.glibc()
    while True:
        time.sleep(1.0)
        start, start_cpu = time.perf_counter(), time.thread_time()
        allocator.give_back_beyond(libc, allocator.KEPT_BOUND)
        cpu, wall = time.thread_time() - start_cpu, time.perf_counter() - start
        info = libc.mallinfo2()
        chunks, anonymous = info.ordblks + info.smblks, allocator.resident_anonymous_bytes()
        samples.append({"check_s": wall, "cpu_s": cpu, "free_chunks": chunks, "rss_anon": anonymous})

atexit.register(lambda: print("CHECKS " + json.dumps(samples)))
threading.Thread(target=watch, daemon=True).start()
sys.argv = [f"stages/{stage}.py"]
runpy.run_path(f"stages/{stage}.py", run_name="__main__")
"""


def child(script: str, *args: str) -> dict:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "RLHF_MALLOC": "keep", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"allocator_check_cost: a child process failed (exit {done.returncode}):\n{done.stderr}")
    return json.loads(done.stdout)


def refuse_persisted(stage: str) -> None:
    """Exit naming the stage when it keeps a persisted output: it would resume from it instead of running."""
    outs = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"][stage].get("outs", [])
    if any(isinstance(out, dict) and next(iter(out.values())).get("persist") for out in outs):
        sys.exit(
            f"allocator_check_cost: stage {stage} keeps a persisted output (its checkpoint) and would resume "
            "from it instead of running; name a stage without one (evaluate, preferences, corpus)."
        )


def watched_stage(stage: str) -> list[str]:
    """One stage run under the watching thread, in this checkout; its outputs are put back from DVC's cache
    after, so the workspace stays as ``dvc.lock`` says."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "RLHF_MALLOC": "keep",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    done = subprocess.run([sys.executable, "-c", STAGE, stage], cwd=REPO, env=env, capture_output=True, text=True)
    subprocess.run(["dvc", "checkout", "--force", "--quiet", stage], cwd=REPO, env=env, check=True)
    if done.returncode != 0:
        sys.exit(f"allocator_check_cost: stage {stage} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    checks = json.loads(done.stdout.rsplit("CHECKS ", 1)[1])
    seconds = float(re.search(rf"stage {stage}: done in (\d+) s", done.stdout + done.stderr).group(1))
    spent = sorted(check["check_s"] * 1e3 for check in checks)  # wall: it includes waiting for a core
    share = statistics.mean(check["cpu_s"] for check in checks) / CHECK_SECONDS  # of one core, at the shipped rate
    return [
        f"`{stage}`",
        f"{seconds:.0f}",
        str(len(spent)),
        f"{statistics.median(spent):.2f}",
        f"{spent[int(0.9 * len(spent))]:.2f}",
        f"{spent[-1]:.1f}",
        f"{statistics.median(check['free_chunks'] for check in checks):.0f}",
        f"{sum(check['rss_anon'] > KEPT_BOUND for check in checks) / len(checks):.0%}",
        f"{share:.2%}",
        f"{share * seconds:.1f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=20_000, help="tensors in the fragmented heap (default 20000)")
    parser.add_argument(
        "--stages",
        nargs="*",
        default=[],
        help="default-run stages to run watched (their outputs must be up to date: `dvc status` clean)",
    )
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--output")
    args = parser.parse_args()
    for stage in args.stages:
        refuse_persisted(stage)

    flops_before = measured_matmul_flops()
    check = child(ONE_CHECK, str(args.blocks))
    stage_rows = [watched_stage(stage) for stage in args.stages]
    flops_after = measured_matmul_flops()

    per_period = 1e6 * CHECK_SECONDS
    check_rows = [
        ["`/proc/self/status` read (RssAnon)", f"{check['proc']:.1f}", f"{check['proc'] / per_period:.2e}"],
        ["`mallinfo2`", f"{check['mallinfo2']:.1f}", f"{check['mallinfo2'] / per_period:.2e}"],
        [
            "`kept_bytes` (both: a check over the bound)",
            f"{check['kept_bytes']:.1f}",
            f"{check['kept_bytes'] / per_period:.2e}",
        ],
        ["a check within the bound (`/proc` alone)", f"{check['within']:.1f}", f"{check['within'] / per_period:.2e}"],
    ]
    tables = [
        render_table(
            ["one call, fragmented heap", "median µs", "share of one core at the shipped rate"],
            check_rows,
            args.markdown,
        )
    ]
    if stage_rows:
        headers = [
            "stage",
            "s",
            "checks timed",
            "wall ms a check, median",
            "p90",
            "max",
            "free chunks (median)",
            "checks with RssAnon over the bound",
            "CPU share of one core at the shipped rate",
            "CPU s at the shipped rate",
        ]
        tables.append(render_table(headers, stage_rows, args.markdown))
    env = [
        f"CPU: {cpu_name()}",
        f"fp32 2048² product: {flops_before / 1e9:.0f} GFLOP/s before, {flops_after / 1e9:.0f} after",
        f"fragmented heap: {check['heap_mb']:.0f} MB in the main arena, {check['free_chunks']} free chunks",
        f"the bounding thread checks every {CHECK_SECONDS} s (`allocator.CHECK_SECONDS`)",
    ]
    notes = [
        "`mallinfo2` walks every free chunk of every arena under that arena's lock, so a check over the bound "
        "costs what the heap's fragmentation makes it cost; the `/proc` read alone is flat.",
        "A stage's wall times include the checking thread's waits for a core (the stage's torch threads hold "
        "both); its CPU share is the thread's own CPU time (`time.thread_time`) over the shipped period.",
        "While `RssAnon` is at most the bound, what is kept cannot pass it: those checks make no `mallinfo2` walk "
        "(`give_back_beyond` reads `/proc` alone).",
    ]
    emit(
        render_report("What the bound on kept memory costs", env, "\n\n".join(tables), notes, args.markdown),
        args.output,
    )


if __name__ == "__main__":
    main()
