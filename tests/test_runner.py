"""The stage runner's own bookkeeping (params restriction is tested in test_dvc_yaml.py)."""

from __future__ import annotations

import subprocess
import sys


def test_stage_time_counts_from_process_start():
    """The reported stage time includes what happens before the stage body (interpreter start,
    imports): a process that sleeps 1 s before asking reports at least 1 s."""
    code = "import time; time.sleep(1.0); from rlhf_pipeline.runner import seconds_since_process_start as s; print(s())"
    seconds = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 1.0 <= seconds < 60.0
