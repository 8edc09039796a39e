"""An adversarial round of labels for the promotion-gate demo (bench/results/promotion_demo.md):
the project's preference data exported as pairs (`rlhf export-preferences`, both splits) with
chosen and rejected swapped, in one file with a split column, ready for the retrain flow's
``--incoming``.

    python bench/promotion_demo_inverted_labels.py /tmp/inverted.jsonl
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path


def main(out: str) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for split in ("train", "test"):
            pairs = Path(folder, f"{split}.jsonl")
            subprocess.run(["rlhf", "export-preferences", str(pairs), "--split", split], check=True)
            for line in pairs.read_text().splitlines():
                row = json.loads(line)
                swapped = {"chosen": row["rejected"], "rejected": row["chosen"]}
                rows.append({"prompt": row["prompt"], **swapped, "split": split})
    Path(out).write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    print(f"{out}: {len(rows)} rows, every label inverted")


if __name__ == "__main__":
    main(sys.argv[1])
