"""``compute``: what the stages that compute run on: the device and its precision, the CPU's
numerics. Read by every stage that runs a model, which declares it in ``dvc.yaml``: a change reruns
them, since it changes their bytes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlhf_pipeline.params import Strict, refuse

MAX_THREADS = 1024


class ComputeParams(Strict):
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="Where every stage that runs a model runs (rlhf_pipeline/devices.py): auto: the GPU when torch "
        "sees one (each process of `accelerate launch` its local rank's), else the CPU; cuda: a GPU or exit 2; cpu: "
        "the CPU even on a GPU host. The resolved device is recorded in each stage's metrics and model card.",
    )
    cuda_precision: Literal["bf16", "fp32"] = Field(
        "bf16",
        description="On CUDA: bf16 autocast over fp32 weights with TF32 matmuls (bf16), or fp32 throughout (fp32). "
        "The CPU always computes in fp32 (bf16 there is ~25x slower without AMX).",
    )
    cuda_sampler: Literal["static", "eager"] = Field(
        "static",
        description="On CUDA: static: sample over a static KV cache with the decoding step compiled as CUDA graphs "
        "(rlhf_pipeline/static_sampling.py; the same draws, fewer kernel launches), where a call allows it (no "
        "trunk split, one process); eager: the eager sampler everywhere. The CPU always samples eagerly.",
    )
    cpu_numerics: Literal["portable", "compatible", "native"] = Field(
        "portable",
        description="portable: torch's CPU kernels, MKL's branch and oneDNN pinned at AVX2, and cpu_threads threads: "
        "the same bytes on any Intel CPU with AVX2 and on AMD CPUs alike (MKL keeps its own Zen path there); "
        "compatible: portable with MKL's COMPATIBLE branch, the same bytes on Intel and AMD CPUs, GEMMs 2.2x "
        "slower; native: this host's fastest kernels, whose rounding is its own (rlhf_pipeline/numerics.py).",
    )
    attention: Literal["sdpa", "invariant"] = Field(
        "sdpa",
        description="The attention of every model with transformers' default (sdpa) implementation "
        "(rlhf_pipeline/attention.py): sdpa: torch's fused kernel; invariant: both products as exact float64 "
        "sums, so no BLAS, CPU vendor or thread count changes their bytes, and a token decoded from a KV cache "
        "and the same token in a full forward get the same bytes (PPO's rollout-trainer gap is 0 on the CPU), at "
        "about 1.1x a training step and 1.15x sampling on the CPU (bench/results/logprob_gap_probe.md).",
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
