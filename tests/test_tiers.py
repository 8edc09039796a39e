"""The test tiers mean what they say: outside `e2e`, a test that starts a stage, a pipeline, a server
or a browser fails at once, naming the command (tests/conftest.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import e2e_command, run_stage_script


@pytest.mark.parametrize(
    "command, what",
    [
        (["dvc", "repro"], "dvc repro"),
        ([sys.executable, "-m", "dvc", "repro", "--single-item", "train_policy"], "dvc repro"),
        (["python", "stages/train_reward.py"], "a pipeline stage"),
        ([sys.executable, "/work/x/stages/evaluate.py"], "a pipeline stage"),
        (
            [sys.executable, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app"],
            "a Prefect server or worker",
        ),
        (["/usr/lib/postgresql/15/bin/initdb", "-D", "x"], "PostgreSQL"),
        (["/usr/sbin/sshd", "-D"], "an SSH server"),
        (["/usr/bin/chromium", "--headless"], "Chromium"),
        ([".label-studio/bin/label-studio", "start"], "Label Studio"),
        (["accelerate", "launch", "stages/train_policy.py"], "a pipeline stage"),
        ([sys.executable, "-c", "driver", "/work/x/stages", "corpus"], "a pipeline stage"),
        (["git", "status"], None),
        ([sys.executable, "-m", "rlhf_pipeline.cli", "check-params"], None),
        (["dvc", "status", "/tmp/test_reproducible_run"], None),  # a path that merely holds the word
    ],
)
def test_the_commands_only_e2e_tests_may_start(command, what):
    assert e2e_command(command) == what


def test_a_unit_test_that_starts_one_fails_naming_it():
    with pytest.raises(AssertionError, match=r"runs dvc repro .* but is not marked e2e"):
        subprocess.Popen(["dvc", "repro"])
    with pytest.raises(AssertionError, match=r"runs the stage corpus \(in-process\) but is not marked e2e"):
        run_stage_script("corpus")
    assert subprocess.run(["git", "--version"], capture_output=True).returncode == 0  # the rest runs as ever


@pytest.mark.e2e
def test_an_e2e_test_may(tmp_path):
    result = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=tmp_path, capture_output=True, text=True)
    assert "not a DVC repository" in (result.stdout + result.stderr) or result.returncode != 0
