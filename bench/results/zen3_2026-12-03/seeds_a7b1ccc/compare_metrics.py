"""Each seed's evaluate metrics in one folder's logs against another's, key by key. By default this
folder's logs (a7b1ccc) against the 13ff438 run's; ``--old``/``--new`` name other logs, with ``{seed}``
where the seed goes (zen3_2026-12-04/seeds compares its fast-hour logs against this folder's)."""

import argparse
import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
p = argparse.ArgumentParser(description=__doc__)
p.add_argument("seeds", nargs="+")
p.add_argument("--old", default=str(HERE.parents[1] / "responses_per_query_2026-12-01" / "seed_{seed}_k2.log"))
p.add_argument("--new", default=str(HERE / "seed_{seed}_head.log"))
args = p.parse_args()


def metrics(path):
    text = open(path, errors="replace").read()
    blocks = re.findall(r'^\{\n "proxy/base_mean".*?^\}', text, re.S | re.M)
    return json.loads(blocks[-1])


for s in args.seeds:
    old = metrics(args.old.format(seed=s))
    new = metrics(args.new.format(seed=s))
    same = [k for k in old if old[k] == new.get(k)]
    diff = {k: (old[k], new.get(k)) for k in old if old[k] != new.get(k)}
    print(f"seed {s}: {len(same)} same, differ: {diff}")
