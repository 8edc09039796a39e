"""What pinning the CPU numerics costs: the same work under each ``compute.cpu_numerics``, one table.

Two workloads, each run in fresh processes under each setting, with its ratio to ``portable`` (the
default) measured in the same run:

- the tiny profile's ``dvc repro preferences`` (``params/tiny.yaml``: base_model, corpus, queries and
  preferences, in a scratch copy of the project), under ``portable``, ``compatible``, and ``native``
  with the environment's ``ATEN_CPU_CAPABILITY`` at ``avx2`` and at ``default`` (what a host's
  dispatch level costs);
- one PPO update on SmolLM2-135M (``bench/ppo_throughput.py --only shared``: 16 episodes, q64/r24,
  1 warm-up + ``--updates`` timed updates), under ``portable``, ``compatible`` and ``native``.

    .venv/bin/python bench/numerics_cost.py [--updates 2] [--skip-ppo] [--markdown] [--output FILE]
"""

from __future__ import annotations

import rlhf_pipeline.offline  # noqa: F401  (first: offline and quiet before the libraries load)

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from common import emit_table, environment_lines

from rlhf_pipeline import allocator

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
COPIED = ("dvc.yaml", "requirements.lock", "stages", "rlhf_pipeline", "data", ".dvcignore")
PINNED_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
# (label, compute.cpu_numerics, environment the user would have set)
TINY_SETTINGS = [
    ("portable", "portable", {}),
    ("compatible", "compatible", {}),
    ("native, ATEN_CPU_CAPABILITY=avx2", "native", {"ATEN_CPU_CAPABILITY": "avx2"}),
    ("native, ATEN_CPU_CAPABILITY=default", "native", {"ATEN_CPU_CAPABILITY": "default"}),
]
PPO_SETTINGS = ["portable", "compatible", "native"]


def clean_environment(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in PINNED_VARIABLES}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    return {**env, **extra}


def tiny_repro_seconds(mode: str, extra: dict[str, str]) -> float:
    with tempfile.TemporaryDirectory(prefix="numerics-cost-") as scratch:
        root = Path(scratch)
        for item in COPIED:
            source = REPO / item
            if source.is_dir():
                shutil.copytree(source, root / item, ignore=shutil.ignore_patterns("__pycache__"))
            elif source.exists():
                shutil.copy(source, root / item)
        params = yaml.safe_load((REPO / "params/tiny.yaml").read_text())
        params["compute"] = {"cpu_numerics": mode, "cpu_threads": 2}
        (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        env = clean_environment(extra)
        git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost"]
        setup = (["git", "init", "-q"], ["dvc", "init", "-q"], ["git", "add", "-A"], [*git, "commit", "-qm", "bench"])
        for command in setup:  # DVCLive (train_reward) needs a commit to start from
            subprocess.run(command, cwd=root, env=env, check=True, stdout=subprocess.DEVNULL)
        start = time.perf_counter()
        # up to preferences (the sampling stages): under ATEN_CPU_CAPABILITY=default the tiny model's samples
        # differ, and with seed 3 one of its queries holds a control character, which validate_preferences
        # refuses (docs/numerics.md)
        subprocess.run(["dvc", "repro", "-q", "preferences"], cwd=root, env=env, check=True, stdout=subprocess.DEVNULL)
        return time.perf_counter() - start


def ppo_seconds_per_update(mode: str, updates: int) -> float:
    command = [sys.executable, str(REPO / "bench/ppo_throughput.py"), "--only", "shared"]
    command += ["--updates", str(updates), "--cpu-numerics", mode]
    out = subprocess.run(command, env=clean_environment({}), check=True, capture_output=True, text=True).stdout
    row = next(line for line in out.splitlines() if line.startswith("rlhf_pipeline PPOTrainer"))
    return float(re.split(r"\s{2,}", row.strip())[2])  # implementation, episodes/s, s/update, ...


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=2, help="timed PPO updates per setting")
    parser.add_argument("--skip-ppo", action="store_true", help="the tiny dvc repro only")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--output")
    args = parser.parse_args()
    rows = []
    tiny = [(label, tiny_repro_seconds(mode, extra)) for label, mode, extra in TINY_SETTINGS]
    for label, seconds in tiny:
        ratio = f"{seconds / tiny[0][1]:.2f}x"
        rows.append([f"tiny profile, dvc repro preferences: {label}", f"{seconds:.1f} s", ratio])
    if not args.skip_ppo:
        ppo = [(mode, ppo_seconds_per_update(mode, args.updates)) for mode in PPO_SETTINGS]
        for mode, seconds in ppo:
            rows.append(
                [f"SmolLM2 PPO update (shared value head): {mode}", f"{seconds:.1f} s", f"{seconds / ppo[0][1]:.2f}x"]
            )
    notes = [
        "each row in fresh processes, one after the other, nothing else running; portable is each workload's "
        "reference; every child sets malloc as a stage does (the stages through runner.run_stage, the PPO bench "
        "through bench/common.prepare)",
        "tiny: params/tiny.yaml with compute.cpu_threads 2, `dvc repro preferences` in a scratch copy of the "
        "project (git + dvc init); "
        "native rows set ATEN_CPU_CAPABILITY in the environment, as a user would, and the pin leaves it",
        f"PPO: bench/ppo_throughput.py --only shared --updates {args.updates} --cpu-numerics MODE (s/update, "
        "mean of the timed updates)",
    ]
    allocator.keep_freed_memory()  # only so that the header's memory line says what every timed child ran under
    env = [line for line in environment_lines("tiny-llama; SmolLM2-135M-Instruct") if not line.startswith("cpu ")]
    emit_table(
        "What pinning the CPU numerics costs", env, ["workload: setting", "time", "vs portable"], rows, notes, args
    )


if __name__ == "__main__":
    main()
