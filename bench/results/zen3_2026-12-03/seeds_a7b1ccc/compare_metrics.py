"""Each seed's evaluate metrics at a7b1ccc (this folder's logs) against the 13ff438 run's, key by key."""

import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OLD = HERE.parents[1] / "responses_per_query_2026-12-01"


def metrics(path):
    text = open(path, errors="replace").read()
    blocks = re.findall(r'^\{\n "proxy/base_mean".*?^\}', text, re.S | re.M)
    return json.loads(blocks[-1])


for s in sys.argv[1:]:
    old = metrics(OLD / f"seed_{s}_k2.log")
    new = metrics(HERE / f"seed_{s}_head.log")
    same = [k for k in old if old[k] == new.get(k)]
    diff = {k: (old[k], new.get(k)) for k in old if old[k] != new.get(k)}
    print(f"seed {s}: {len(same)} same, differ: {diff}")
