"""Simulated people answer a side-by-side round (bench/results/promotion_demo.md, the `score: human`
gate): the tasks of `rlhf label compare` in, a Label Studio JSON export of their answers out, ready
for `rlhf label verdicts`. Two people, both judging by VADER's positive sentiment of each response
(the simulated labeller's own judge; they never see which model wrote which):

- ``careful``: the more positive response; a tie when the two are within ``--tie`` of each other;
- ``hasty``: a Bradley-Terry draw, A with probability sigmoid((score A - score B) / ``--temperature``),
  from a seeded generator (the preferences stage's softmax labeller, for two responses).

    python bench/promotion_demo_simulated_people.py tasks.json export.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

from rlhf_pipeline.labelers import get_labeler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tasks")
    parser.add_argument("export")
    parser.add_argument("--tie", type=float, default=0.05)
    parser.add_argument("--temperature", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tasks = json.loads(Path(args.tasks).read_text())
    vader, draw = get_labeler("vader"), random.Random(args.seed)
    export = []
    for number, task in enumerate(tasks, 1):
        a, b = vader.score([task["data"]["response_a"], task["data"]["response_b"]])
        careful = "tie" if abs(a - b) < args.tie else ("a" if a > b else "b")
        hasty = "a" if draw.random() < 1 / (1 + math.exp(-(a - b) / args.temperature)) else "b"
        annotations = [
            {"id": 2 * number + k, "completed_by": who, "was_cancelled": False,
             "result": [{"from_name": "best", "to_name": "query", "type": "choices", "value": {"choices": [choice]}}]}
            for k, (who, choice) in enumerate((("careful", careful), ("hasty", hasty)))
        ]  # fmt: skip
        export.append({"id": number, "data": task["data"], "annotations": annotations})
    Path(args.export).write_text(json.dumps(export, indent=1, ensure_ascii=False))
    print(f"{args.export}: {len(export)} tasks, answered by 2 simulated people")


if __name__ == "__main__":
    main()
