"""Label files for the promotion-gate demos (bench/results/promotion_demo.md): the project's preference
data exported as pairs (`rlhf export-preferences`, both splits), with chosen and rejected swapped, in
one file with a split column, ready for the retrain flow's ``--incoming``.

With ``--golden FILE``, the first ``--golden-rows`` pairs of the held-out split are kept apart, the right
way round, as a golden label set for a frozen judge (``promotion.golden_labels``): a quarter of them held
out again for the judge's own accuracy. The inverted round then holds none of them.

    python bench/promotion_demo_inverted_labels.py /tmp/inverted.jsonl [--golden data/labels/golden.jsonl]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path


def exported_pairs() -> dict[str, list[dict]]:
    """{split: [{prompt, chosen, rejected}]} of the project's preference data."""
    pairs = {}
    with tempfile.TemporaryDirectory() as folder:
        for split in ("train", "test"):
            path = Path(folder, f"{split}.jsonl")
            subprocess.run(["rlhf", "export-preferences", str(path), "--split", split], check=True)
            pairs[split] = [json.loads(line) for line in path.read_text().splitlines()]
    return pairs


def write_rows(path: str, rows: list[dict]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the inverted round (.jsonl)")
    parser.add_argument("--golden", default=None, help="also keep a golden label set apart, here (.jsonl)")
    parser.add_argument("--golden-rows", type=int, default=256)
    args = parser.parse_args()
    pairs = exported_pairs()
    if args.golden:
        golden, pairs["test"] = pairs["test"][: args.golden_rows], pairs["test"][args.golden_rows :]
        held = len(golden) // 4
        rows = [{**row, "split": "train" if i >= held else "test"} for i, row in enumerate(golden)]
        write_rows(args.golden, rows)
        print(f"{args.golden}: {len(rows)} golden rows ({held} held out for the judge's accuracy), the right way round")
    inverted = [
        {"prompt": row["prompt"], "chosen": row["rejected"], "rejected": row["chosen"], "split": split}
        for split, rows in pairs.items()
        for row in rows
    ]
    write_rows(args.out, inverted)
    print(f"{args.out}: {len(inverted)} rows, every label inverted")


if __name__ == "__main__":
    main()
