"""The common entry point of every DVC stage: validate params, restrict them, run, map errors to exit codes."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np

from rlhf_pipeline.env import project_root
from rlhf_pipeline.errors import MissingPackageError, ParamsError, PipelineError, storage_error, storage_failure
from rlhf_pipeline.params import Params, parse_params, read_params_file
from rlhf_pipeline.stage_params import DeclaredParams, declared_param_keys, missing_key_problems

# When set to a folder, each stage writes there the params keys it read (tests compare them with dvc.yaml).
RECORD_READS_ENV = "RLHF_RECORD_PARAM_READS"
UNDECLARED_SEED = 0  # a stage that does not declare `seed` must not depend on it, yet stays deterministic


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def report_error(error: PipelineError, prog: str) -> int:
    if isinstance(error, ParamsError):
        print(f"{prog}: {error.path} is invalid:", file=sys.stderr)
        for line in error.problems:
            print(line, file=sys.stderr)
    else:
        print(f"{prog}: error: {error}", file=sys.stderr)
    return error.exit_code


def report_unexpected(error: Exception, prog: str) -> int:
    """A storage failure outside the atomic writers (a library writing its own files) exits 5 with
    one paragraph; anything else is a bug: its traceback is printed, exit 1."""
    reason = storage_failure(error)
    if reason is not None:
        return report_error(storage_error(reason, getattr(error, "filename", None) or "an output"), prog)
    if isinstance(error, ImportError):
        return report_error(missing_package_error(error), prog)
    traceback.print_exception(error)
    return 1


def missing_package_error(error: ImportError) -> MissingPackageError:
    return MissingPackageError(
        f"{error} (interpreter {sys.executable}). Install the project into that interpreter (`make setup`, or "
        "`pip install -e .`), or run `dvc` from the project's virtual environment (`source .venv/bin/activate`)."
    )


def stage_params(name: str, path: str, root: str | os.PathLike) -> Params | DeclaredParams:
    """What stage ``name`` may read of the params file at ``path``: the validated params,
    restricted to the keys ``dvc.yaml`` declares for it, each of which the file must hold."""
    raw = read_params_file(path)
    params = parse_params(raw, path)
    keys = declared_param_keys(name, root)
    if keys is None:
        return params
    problems = missing_key_problems(raw, {f"stage {name}": keys})
    if problems:
        raise ParamsError(path, problems)
    return DeclaredParams(params, keys, name)


def record_reads(name: str, view: Params | DeclaredParams) -> None:
    folder = os.environ.get(RECORD_READS_ENV)
    if folder and isinstance(view, DeclaredParams):
        Path(folder).mkdir(parents=True, exist_ok=True)
        Path(folder, f"{name}.json").write_text(json.dumps(sorted(view.reads)) + "\n")


def seconds_since_process_start() -> float:
    """Wall time since this process was created: the stage's whole cost, Python and torch imports
    included, so the stage times in `dvc repro`'s log add up to its wall time."""
    import psutil

    return time.time() - psutil.Process().create_time()


def run_stage(name: str, body: Callable[[Params], None], argv: list[str] | None = None) -> None:
    """Parse ``--params``, validate, restrict to the declared keys, seed, and call ``body(params)``;
    exit non-zero on user errors.

    Unexpected exceptions still print their traceback: those are bugs, and hiding them would
    make them harder to report.
    """
    parser = argparse.ArgumentParser(prog=f"stage {name}")
    parser.add_argument("--params", default=os.environ.get("RLHF_PARAMS", "params.yaml"))
    args = parser.parse_args(argv)
    try:
        params = stage_params(name, args.params, project_root())
        declares_seed = not isinstance(params, DeclaredParams) or params.declares("seed")
        seed_everything(params.seed if declares_seed else UNDECLARED_SEED)
        body(params)
        record_reads(name, params)
        print(f"stage {name}: done in {seconds_since_process_start():.0f} s", flush=True)
    except PipelineError as error:
        sys.exit(report_error(error, f"stage {name}"))
    except KeyboardInterrupt:
        print(f"stage {name}: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as error:
        sys.exit(report_unexpected(error, f"stage {name}"))
