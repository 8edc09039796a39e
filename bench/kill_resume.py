"""Kill ``train_policy`` with SIGKILL between two checkpoints, rerun it, and compare with an uninterrupted run.

The end-to-end test ``tests/test_ppo.py::test_stage_killed_with_sigkill_resumes_bit_identical`` checks this on
the CPU with ``compute.device: cpu``. This script checks it on whatever device the project's params choose
(``compute.device: auto`` takes a GPU where there is one), in a project whose ``train_policy`` inputs exist (for
example after ``rlhf profile tiny && dvc repro``). It copies the project twice, sets ``ppo.total_episodes`` and
``ppo.checkpoint_every`` in both copies, runs the stage whole in one, and in the other kills it once an update past
a checkpoint is logged, then reruns it there.

Usage (from the project root)::

    python bench/kill_resume.py [--project .] [--episodes 160] [--checkpoint-every 2] [--work /tmp/kill_resume]

Prints one JSON object: where the kill landed, whether the rerun resumed, and whether the resumed policy's
weights and DVCLive series equal the uninterrupted run's. Exit 0 when they do, 1 when not.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

LEFT_BEHIND = (".git", ".dvc/cache", ".dvc/tmp", "checkpoints", "dvclive", "models/policy", ".venv", ".gpu", ".gpu-all")
SCORE = "dvclive/train_policy/plots/metrics/objective/score.tsv"
META = "checkpoints/policy/state/meta.json"
SERIES = ("objective/score", "objective/kl", "loss/policy")


def copy_project(source: Path, target: Path, episodes: int, every: int) -> None:
    shutil.rmtree(target, ignore_errors=True)
    skip = {source / name for name in LEFT_BEHIND}
    shutil.copytree(source, target, ignore=lambda folder, names: [n for n in names if Path(folder, n) in skip])
    params = yaml.safe_load((target / "params.yaml").read_text())
    params["ppo"] |= {"total_episodes": episodes, "checkpoint_every": every}
    (target / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def start_stage(project: Path) -> subprocess.Popen:
    env = {**os.environ, "RLHF_PROJECT_ROOT": str(project), "GIT_DIR": "/nonexistent"}
    command = [sys.executable, "stages/train_policy.py"]
    return subprocess.Popen(command, cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def logged_updates(project: Path) -> int:
    path = project / SCORE
    return max(len(path.read_text().splitlines()) - 1, 0) if path.exists() else 0


def kill_between_checkpoints(project: Path, every: int, timeout: float) -> dict:
    """Start the stage, SIGKILL it once the checkpoint exists and the log holds an update past it."""
    victim, deadline = start_stage(project), time.time() + timeout
    while time.time() < deadline and victim.poll() is None:
        if (project / META).exists() and logged_updates(project) % every != 0:
            victim.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    output, _ = victim.communicate(timeout=timeout)
    killed = victim.returncode == -signal.SIGKILL
    checkpoint = json.loads((project / META).read_text())["update"] if (project / META).exists() else None
    return {
        "killed": killed,
        "returncode": victim.returncode,
        "checkpoint_update": checkpoint,
        "logged_updates": logged_updates(project),
        "output_tail": output[-400:] if not killed else "",
    }


def series(project: Path, name: str) -> list[tuple[str, str]]:
    """(step, value) rows of a DVCLive series (the timestamp column differs by design)."""
    lines = (project / "dvclive/train_policy/plots/metrics" / f"{name}.tsv").read_text().splitlines()
    header = lines[0].split("\t")
    step = header.index("step")
    return [(row.split("\t")[step], row.split("\t")[-1]) for row in lines[1:]]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", type=Path, default=Path("."))
    parser.add_argument("--episodes", type=int, default=160)
    parser.add_argument("--checkpoint-every", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("/tmp/kill_resume"))
    parser.add_argument("--timeout", type=float, default=240.0)
    args = parser.parse_args()
    whole, killed = args.work / "whole", args.work / "killed"
    for target in (whole, killed):
        copy_project(args.project.resolve(), target, args.episodes, args.checkpoint_every)
    started = time.time()
    out, _ = start_stage(whole).communicate(timeout=args.timeout)
    report = {"whole_seconds": round(time.time() - started, 1)}
    if not (whole / "models/policy/model.safetensors").exists():
        print(json.dumps(report | {"error": "the uninterrupted run failed", "output_tail": out[-2000:]}, indent=1))
        return 1
    report["kill"] = kill_between_checkpoints(killed, args.checkpoint_every, args.timeout)
    rerun = start_stage(killed)
    out, _ = rerun.communicate(timeout=args.timeout)
    report["rerun_returncode"] = rerun.returncode
    report["resumed"] = next((line for line in out.splitlines() if "resuming from update" in line), None)
    report["device"] = json.loads((whole / "metrics/policy.json").read_text()).get("device")
    policy = "models/policy/model.safetensors"
    report["weights_equal"] = (killed / policy).exists() and sha256(whole / policy) == sha256(killed / policy)
    report["series_equal"] = {name: series(whole, name) == series(killed, name) for name in SERIES}
    report["updates"] = len(series(whole, "objective/score"))
    print(json.dumps(report, indent=1))
    ok = (
        report["kill"]["killed"]
        and report["resumed"]
        and report["weights_equal"]
        and all(report["series_equal"].values())
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
