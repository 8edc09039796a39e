"""The stage runner's own bookkeeping (params restriction is tested in test_dvc_yaml.py)."""

from __future__ import annotations

import gc
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def test_stage_time_counts_from_process_start():
    """The reported stage time includes what happens before the stage body (interpreter start,
    imports): a process that sleeps 1 s before asking reports at least 1 s."""
    code = "import time; time.sleep(1.0); from rlhf_pipeline.runner import seconds_since_process_start as s; print(s())"
    seconds = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 1.0 <= seconds < 60.0


@pytest.mark.e2e
def test_a_stage_run_by_a_python_without_the_project_exits_6_naming_what_is_missing(tmp_path):
    """`.venv/bin/dvc repro` with no venv active runs the system's `python`, which lacks the project:
    the stage stops at its first import (stages/_interpreter.py) with exit 6, the missing package
    and the fix, not a traceback and exit 1 (which the retrain flow would retry)."""
    import _interpreter

    from rlhf_pipeline.errors import MissingPackageError

    assert _interpreter.MISSING_PACKAGE_EXIT_CODE == MissingPackageError.exit_code
    stages = Path(__file__).resolve().parents[1] / "stages"
    for script in sorted(stages.glob("[!_]*.py")):
        # -S: no site-packages, so neither the project nor torch can be imported
        ran = subprocess.run([sys.executable, "-S", str(script)], cwd=tmp_path, capture_output=True, text=True)
        assert ran.returncode == MissingPackageError.exit_code, (script.name, ran.stderr)
        assert "No module named 'rlhf_pipeline'" in ran.stderr and "source .venv/bin/activate" in ran.stderr
        assert "Traceback" not in ran.stderr


@pytest.mark.e2e
def test_a_stage_runs_its_own_checkout_s_package_not_the_installed_one(tmp_path):
    """`dvc exp run --queue` and `--temp` run the stages in a copy of the checkout, and the editable
    install points at the workspace: a stage must import the package of the checkout it runs from,
    whose files its dvc.lock hashes, not the workspace's."""
    repo = Path(__file__).resolve().parents[1]
    copy = tmp_path / "copy"
    (copy / "stages").mkdir(parents=True)
    shutil.copy(repo / "stages" / "_interpreter.py", copy / "stages")
    shutil.copytree(repo / "rlhf_pipeline", copy / "rlhf_pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    probe = "import _interpreter\nimport rlhf_pipeline.metric_keys as keys\nprint(keys.__file__)\n"
    (copy / "stages" / "probe.py").write_text(probe)
    ran = subprocess.run([sys.executable, "stages/probe.py"], cwd=copy, capture_output=True, text=True, check=True)
    assert Path(ran.stdout.strip()) == copy / "rlhf_pipeline" / "metric_keys.py"
    # without the package beside it (a scratch folder holding only the scripts), the installed one serves
    shutil.rmtree(copy / "rlhf_pipeline")
    ran = subprocess.run([sys.executable, "stages/probe.py"], cwd=copy, capture_output=True, text=True, check=True)
    assert Path(ran.stdout.strip()) == repo / "rlhf_pipeline" / "metric_keys.py"


PROBE_STAGE = """\
import _interpreter
import gc

off_for_the_imports = not gc.isenabled()
import torch  # noqa: E402,F401  (what a stage imports: the objects the collector would walk)

from rlhf_pipeline.params import StageParams  # noqa: E402
from rlhf_pipeline.runner import run_stage  # noqa: E402


def main(params):
    print(off_for_the_imports, gc.isenabled(), gc.get_freeze_count())


run_stage("probe", main, StageParams)
"""


@pytest.mark.e2e
def test_a_fresh_stage_process_imports_with_the_collector_off_and_runs_with_it_on(tmp_path):
    """stages/_interpreter.py turns the collector off for a fresh stage process's imports, and
    run_stage freezes what they made (out of every later collection) and turns it back on before the
    stage body runs; a process that had imported the package already (a test running a stage in
    process) keeps its collector on."""
    import _interpreter  # noqa: F401  (imported here with the package loaded: the collector stays on)

    assert gc.isenabled()
    repo = Path(__file__).resolve().parents[1]
    (tmp_path / "stages").mkdir()
    shutil.copy(repo / "stages" / "_interpreter.py", tmp_path / "stages")
    (tmp_path / "stages" / "probe.py").write_text(PROBE_STAGE)
    (tmp_path / "dvc.yaml").write_text("stages:\n  probe:\n    cmd: python stages/probe.py\n    params: [seed]\n")
    (tmp_path / "params.yaml").write_text("seed: 3\n")
    ran = subprocess.run([sys.executable, "stages/probe.py"], cwd=tmp_path, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    off_for_the_imports, on_in_the_body, frozen = ran.stdout.splitlines()[0].split()
    assert (off_for_the_imports, on_in_the_body) == ("True", "True")
    assert int(frozen) > 50_000  # torch's modules, classes and functions, out of the collector's reach
