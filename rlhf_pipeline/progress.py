"""Progress lines for the stages' long loops: one line per batch with a count and the elapsed time,
flushed at once, so `dvc repro` and the retrain flow show where a stage is (Hugging Face's own
load/save bars are off, see :mod:`rlhf_pipeline.env`)."""

from __future__ import annotations

import time


class Progress:
    """``Progress("preferences train", 1024, "rows").update(256)`` prints
    ``preferences train: 256/1024 rows (41 s)``."""

    def __init__(self, label: str | None, total: int, unit: str):
        self.label, self.total, self.unit = label, total, unit
        self.started = time.perf_counter()

    def update(self, done: int) -> None:
        if self.label is not None:
            elapsed = time.perf_counter() - self.started
            print(f"{self.label}: {min(done, self.total)}/{self.total} {self.unit} ({elapsed:.0f} s)", flush=True)
