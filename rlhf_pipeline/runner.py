"""The common entry point of every DVC stage: validate params, run, map errors to exit codes."""

from __future__ import annotations

import argparse
import os
import random
import sys
import traceback
from collections.abc import Callable

import numpy as np

from rlhf_pipeline.errors import ParamsError, PipelineError
from rlhf_pipeline.params import Params, load_params


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


def run_stage(name: str, body: Callable[[Params], None], argv: list[str] | None = None) -> None:
    """Parse ``--params``, validate, and call ``body(params)``; exit non-zero on user errors.

    Unexpected exceptions still print their traceback: those are bugs, and hiding them would
    make them harder to report.
    """
    parser = argparse.ArgumentParser(prog=f"stage {name}")
    parser.add_argument("--params", default=os.environ.get("RLHF_PARAMS", "params.yaml"))
    args = parser.parse_args(argv)
    try:
        params = load_params(args.params)
        seed_everything(params.seed)
        body(params)
    except PipelineError as error:
        sys.exit(report_error(error, f"stage {name}"))
    except KeyboardInterrupt:
        print(f"stage {name}: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception:
        traceback.print_exc()
        sys.exit(1)
