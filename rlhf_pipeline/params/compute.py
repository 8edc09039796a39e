"""``compute``: what the stages that compute run on. Read by every stage that runs a model, which
declares it in ``dvc.yaml``: a change reruns them, since it changes their bytes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlhf_pipeline.params import Strict, refuse

MAX_THREADS = 1024


class ComputeParams(Strict):
    cpu_numerics: Literal["portable", "compatible", "native"] = Field(
        "portable",
        description="portable: torch's CPU kernels, MKL's branch and oneDNN pinned at AVX2, and cpu_threads threads: "
        "the same bytes on any Intel CPU with AVX2 and on AMD CPUs alike (MKL keeps its own Zen path there); "
        "compatible: portable with MKL's COMPATIBLE branch, the same bytes on Intel and AMD CPUs, GEMMs 2.2x "
        "slower; native: this host's fastest kernels, whose rounding is its own (rlhf_pipeline/numerics.py).",
    )
    cpu_threads: int | None = Field(
        2,
        gt=0,
        le=MAX_THREADS,
        description="torch threads per process. torch splits large sums between threads, so portable needs a "
        "number; native: null keeps torch's own choice (one per core).",
    )

    @model_validator(mode="after")
    def _a_pin_needs_threads(self) -> ComputeParams:
        if self.cpu_numerics != "native" and self.cpu_threads is None:
            refuse(
                [
                    (
                        "cpu_threads",
                        f"must be a number when cpu_numerics is {self.cpu_numerics}: torch splits large sums between "
                        "its threads, so the same bytes need the same thread count on every host (the default is 2); "
                        "or set cpu_numerics: native",
                        None,
                    )
                ]
            )
        return self
