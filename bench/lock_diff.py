"""Which stage outputs differ between two ``dvc.lock`` files (two runs of the same stages).

DVC's own ``dvc diff`` compares committed revisions; a rerun checked on a machine without a commit
(the GPU host) compares the lock before and after instead. Each stage's outputs are compared by the
hash DVC recorded for them (a folder's is the hash of its listing, so any file in it counts).
Paths given with ``--expect`` (a timing metric, say) may differ: any other difference exits 1.

    .venv/bin/python bench/lock_diff.py /tmp/lock1 dvc.lock --stages train_policy evaluate \
        --expect metrics/speed.json
"""

from __future__ import annotations

import argparse
import sys

import yaml


def outputs_by_stage(lock_path: str) -> dict[str, dict[str, str]]:
    """{stage: {output path: its hash}} from a ``dvc.lock`` (outs, metrics and plots are all ``outs`` there)."""
    with open(lock_path, encoding="utf-8") as handle:
        stages = yaml.safe_load(handle)["stages"]
    return {
        # ``hash`` names the algorithm (md5); an entry without an md5 is compared whole
        name: {out["path"]: out.get("md5") or repr(sorted(out.items())) for out in entry.get("outs", [])}
        for name, entry in stages.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--stages", nargs="*", help="only these stages (default: every stage in either file)")
    parser.add_argument("--expect", nargs="*", default=[], help="outputs allowed to differ")
    args = parser.parse_args(argv)
    before, after = outputs_by_stage(args.before), outputs_by_stage(args.after)
    unexpected = 0
    for stage in args.stages or sorted(set(before) | set(after)):
        old, new = before.get(stage, {}), after.get(stage, {})
        changed = sorted(path for path in set(old) | set(new) if old.get(path) != new.get(path))
        same = len(set(old) | set(new)) - len(changed)
        print(f"{stage}: {same} outputs the same bytes" + (f"; differ: {', '.join(changed)}" if changed else ""))
        unexpected += sum(path not in args.expect for path in changed)
    print("only the expected outputs differ" if not unexpected else f"{unexpected} unexpected outputs differ")
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
