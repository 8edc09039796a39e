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
