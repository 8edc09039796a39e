"""Peak memory and time of `rlhf validate-preferences` on a large pairwise file: the contract
validated in chunks (the shipped path, ``rlhf_pipeline.contract.CHUNK_ROWS`` rows at a time) against
the whole file as one Great Expectations batch (the reference: ``CHUNK_ROWS`` raised past the file),
each in its own process, measured in the same run, under both malloc settings a user meets: glibc's
own (the ``rlhf validate-preferences`` command) and the stages' (``allocator.keep_freed_memory``,
which ``runner.run_stage`` calls before the ``validate_preferences`` stage's body).

Usage (nothing else running; the 1 M-row file is ~190 MiB, written once under --workdir):

    .venv/bin/python bench/validation_memory.py --rows 1000000 --output bench/results/validation_memory.md

Each run prints `ok: N rows passed ...` (the rows are valid); the table gives wall seconds and
peak RSS (the child's own `VmHWM`) and their ratios to the reference.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

# the CLI in a child process, CHUNK_ROWS set first (None: as shipped) and malloc set as a stage sets it
# when asked; prints its peak RSS last
CHILD = """
import json, sys
import rlhf_pipeline.contract as contract
chunk, as_a_stage = json.loads(sys.argv[1]), json.loads(sys.argv[4])
if as_a_stage:
    from rlhf_pipeline import allocator
    assert allocator.keep_freed_memory(), "the stages' malloc setting did not take (RLHF_MALLOC=system?)"
if chunk is not None:
    contract.CHUNK_ROWS = chunk
from rlhf_pipeline.cli import main
try:
    main(["validate-preferences", sys.argv[2], "--params", sys.argv[3]])
except SystemExit as exit_:
    code = exit_.code
from rlhf_pipeline.allocator import peak_rss_mb  # this child's own peak, not this script's as well
print(json.dumps({"code": code, "peak_mb": peak_rss_mb()}))
"""
MALLOC = {False: "glibc's settings (the command)", True: "kept freed memory (the stage)"}


def write_rows(path: Path, rows: int) -> None:
    """``rows`` distinct, valid pairwise rows (a prompt, a kind and a rude reply of a few words)."""
    with open(path, "w") as handle:
        for i in range(rows):
            handle.write(
                json.dumps(
                    {
                        "prompt": f"Tell me what you think of film number {i}, please.",
                        "chosen": f"Film {i} was a pleasure to watch, with a kind story and fine acting.",
                        "rejected": f"Film {i} was dull and I want my evening back.",
                    }
                )
                + "\n"
            )


def measure(chunk: int | None, data: Path, params: Path, as_a_stage: bool) -> dict:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(chunk), str(data), str(params), json.dumps(as_a_stage)],
        capture_output=True,
        text=True,
        check=False,
    )
    seconds = time.perf_counter() - start
    if done.returncode != 0:  # the child reports the command's own exit code; this is the child itself failing
        raise SystemExit(f"the validation child failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    last = json.loads(done.stdout.strip().splitlines()[-1])
    first = done.stdout.strip().splitlines()[0]
    return {"seconds": seconds, "peak_mb": last["peak_mb"], "code": last["code"], "said": first[:160]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/validation_memory"))
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    data = args.workdir / f"pairs_{args.rows}.jsonl"
    if not data.is_file():
        write_rows(data, args.rows)
    params = args.workdir / "params.yaml"  # the schema's defaults: min_rows 64, test_fraction 0.1
    params.write_text("seed: 1\n")
    runs = {}  # (path, malloc) -> run; each path against the one batch under the same malloc setting
    for as_a_stage in (False, True):
        runs["one batch (reference)", as_a_stage] = measure(10**12, data, params, as_a_stage)
        runs["in chunks (shipped)", as_a_stage] = measure(None, data, params, as_a_stage)
    lines = [
        f"The contract on {args.rows:,} pairwise rows ({data.stat().st_size / 2**20:.0f} MiB) through `rlhf "
        "validate-preferences`, each in its own process:",
        "",
        "| path | malloc | exit | wall s | peak RSS MB | time vs reference | peak vs reference |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for (name, as_a_stage), run in runs.items():
        reference = runs["one batch (reference)", as_a_stage]
        lines.append(
            f"| {name} | {MALLOC[as_a_stage]} | {run['code']} | {run['seconds']:.0f} | {run['peak_mb']:.0f} | "
            f"{run['seconds'] / reference['seconds']:.2f} | {run['peak_mb'] / reference['peak_mb']:.2f} |"
        )
    lines += ["", *(f"- {name}, {MALLOC[stage]}: {run['said']}" for (name, stage), run in runs.items())]
    text = "\n".join(lines)
    print(text)
    if args.output:
        args.output.write_text(
            f"# Validation memory\n\nCommand: `.venv/bin/python bench/validation_memory.py --rows {args.rows}`\n\n"
            + text
            + "\n"
        )


if __name__ == "__main__":
    main()
