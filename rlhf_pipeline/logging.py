"""DVCLive set-up shared by the training stages: plots under dvclive/<stage>, no DVC experiments."""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def open_live(directory: str):
    from dvclive import Live

    os.environ.setdefault("DVCLIVE_LOGLEVEL", "WARNING")
    # The stage itself is the DVC experiment unit; dvclive must not start its own.
    live = Live(dir=directory, save_dvc_exp=False, dvcyaml=None, report=None)
    try:
        yield live
    finally:
        live.end()


def step_logger(live, keys: tuple[str, ...] | None = None, prefix: str = ""):
    """A trainer's ``log(record)`` callback: each key of the record (``keys`` only, when given; never
    ``update``, the step itself) as a DVCLive metric named ``prefix + key``, then the next step. With
    ``live`` None (a process other than the main one) it logs nothing."""

    def log(record: dict) -> None:
        if live is None:
            return
        for key in keys if keys is not None else [k for k in record if k != "update"]:
            live.log_metric(prefix + key, record[key])
        live.next_step()

    return log
