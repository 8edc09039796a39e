"""The first import of every stage script. It sits beside them, so whatever Python runs a stage finds
it: one that lacks the project's packages (`.venv/bin/dvc repro` without the venv activated runs the
system's `python`) stops here with exit 6 naming the missing package and the fix, instead of a
ModuleNotFoundError traceback and exit 1, the code the retrain flow retries. Standard library only.
"""

import gc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

# The collector is off while a fresh stage process imports torch, transformers and datasets. Those
# imports leave about 360,000 objects for it to track, all alive until the process ends, and would set
# off some 900 collections on the way (six of them walking everything imported so far: 0.8 s). Then
# runner.run_stage moves what was imported out of the collector's reach (gc.freeze) and turns it back
# on, so no later collection walks it either, the interpreter's last ones at exit included. Together
# a fifth to a quarter of a tiny stage's time (bench/results/process_start.md). A test that runs a
# stage in the test's own process (runpy) has imported the package already, and keeps its collector.
if "rlhf_pipeline" not in sys.modules:
    gc.disable()

# rlhf_pipeline.errors.MissingPackageError.exit_code, which cannot be imported from a Python that lacks
# the package; tests/test_runner.py checks that the two agree
MISSING_PACKAGE_EXIT_CODE = 6
REQUIRED = ("rlhf_pipeline", "torch", "transformers", "datasets", "dvc")

missing = [name for name in REQUIRED if importlib.util.find_spec(name) is None]
if missing:
    sys.stderr.write(
        f"ERROR: No module named {missing[0]!r} (missing: {', '.join(missing)}) in {sys.executable}, the Python "
        "running this stage: it is not the project's. Run `dvc` with the project's virtual environment active "
        "(`source .venv/bin/activate`; `make setup` creates it), or with .venv/bin first on PATH.\n"
    )
    sys.exit(MISSING_PACKAGE_EXIT_CODE)

# A stage runs the code dvc.yaml hashes: the package in this checkout, beside this folder. Without this,
# `rlhf_pipeline` is whichever copy the environment's install points at, and an editable install points
# at one checkout: `dvc exp run --queue` or `--temp` runs the stages in a copy elsewhere, so edits made
# in the workspace meanwhile ran while the experiment's dvc.lock recorded its own copy's hashes. Bound
# only in a fresh stage process (a test may have imported the package already) and only where the
# checkout holds the package.
CHECKOUT = Path(__file__).resolve().parents[1]
if "rlhf_pipeline" not in sys.modules:
    spec = importlib.machinery.PathFinder.find_spec("rlhf_pipeline", [str(CHECKOUT)])
    if spec is not None and spec.submodule_search_locations is not None:
        package = importlib.util.module_from_spec(spec)
        sys.modules["rlhf_pipeline"] = package
        spec.loader.exec_module(package)
