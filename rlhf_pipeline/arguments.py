"""Types for command-line arguments, shared by ``rlhf`` and ``python -m flows.retrain``: a value outside
its range is argparse's usage error (exit 2, the argument named) before anything loads, not a traceback
or a run out of memory later."""

from __future__ import annotations

import argparse
import math

from rlhf_pipeline.errors import quoted


def whole_number(low: int, high: int | None = None):
    """An argparse ``type`` for a whole number from ``low`` to ``high`` (none: no upper bound). `rlhf label
    export --n 100000` sampled until the kernel killed it, and `--num 0` ended in max() of nothing."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{quoted(text, 40)} is not a whole number") from None
        if value < low or (high is not None and value > high):
            span = f"from {low:,} to {high:,}" if high is not None else f"of at least {low:,}"
            raise argparse.ArgumentTypeError(f"{value:,} is not a whole number {span}")
        return value

    return parse


def fraction(text: str) -> float:
    """An argparse ``type`` for a share from 0 to 1 (`--min-agreement nan` passed every export: no agreement
    is below NaN)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{quoted(text, 40)} is not a number") from None
    if not 0 <= value <= 1:  # NaN fails both
        raise argparse.ArgumentTypeError(f"{quoted(text, 40)} is not a share from 0 to 1")
    return value


def seconds(text: str) -> float:
    """An argparse ``type`` for a duration in seconds: a finite number of at least 0 (`--retry-delay nan`
    would reach Prefect's backoff as NaN)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{quoted(text, 40)} is not a number of seconds") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{quoted(text, 40)} is not a finite number of seconds of at least 0")
    return value
