"""Each seed's evaluate metrics in this folder's logs against the same seed's run at a7b1ccc, key by key."""

import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OLD = HERE.parents[1] / "zen3_2026-12-03" / "seeds_a7b1ccc"


def metrics(path):
    text = open(path, errors="replace").read()
    blocks = re.findall(r'^\{\n "proxy/base_mean".*?^\}', text, re.S | re.M)
    return json.loads(blocks[-1])


for s in sys.argv[1:]:
    old = metrics(OLD / f"seed_{s}_head.log")
    new = metrics(HERE / f"seed_{s}_fast.log")
    same = [k for k in old if old[k] == new.get(k)]
    diff = {k: (old[k], new.get(k)) for k in old if old[k] != new.get(k)}
    print(f"seed {s}: {len(same)} of {len(old)} the same, differ: {diff}")
