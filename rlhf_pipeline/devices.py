"""The one device rule: where a stage that runs a model runs, and in what precision.

Every such stage (corpus, preferences, train_reward, normalize_reward, train_policy, evaluate)
resolves ``compute.device`` here once, moves its models to :attr:`DevicePlan.device`, runs their
forwards inside :meth:`DevicePlan.autocast`, and records :meth:`DevicePlan.describe` in its metrics
and model card: DVC cannot see a workspace move from a CPU host to a GPU host (``auto`` resolves
differently with the same params), so the record is what tells two runs apart.

- CPU: fp32 (bf16 on a CPU without AMX is ~25x slower than fp32 and rounds worse).
- CUDA (``compute.cuda_precision: bf16``): bf16 autocast over fp32 weights (the optimiser's master
  copy stays fp32), TF32 matmuls; ``fp32`` turns both off. Deterministic where torch can be:
  ``CUBLAS_WORKSPACE_CONFIG`` set before cuBLAS starts, deterministic algorithms (warning, not
  failing, on ops that have none), cuDNN autotuning off.

Several processes (``accelerate launch``): each takes the GPU of its local rank.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from rlhf_pipeline.attention import use_attention
from rlhf_pipeline.errors import SettingsError

DEVICE_KEY = "compute.device"
STATIC_SAMPLER, EAGER_SAMPLER = "static", "eager"  # compute.cuda_sampler's values
CUDA_SAMPLERS = (STATIC_SAMPLER, EAGER_SAMPLER)
# cuBLAS picks reduction splits by workspace; a fixed configuration makes its GEMMs deterministic
# (https://docs.nvidia.com/cuda/cublas/#results-reproducibility). Read when cuBLAS initialises.
CUBLAS_WORKSPACE = ":4096:8"


class DeviceError(SettingsError):
    """``compute.device`` asks for a device this host does not have: exit 2."""


@dataclass(frozen=True)
class DevicePlan:
    device: torch.device
    autocast_dtype: torch.dtype | None  # bf16 autocast on CUDA; None (fp32) on CPU or compute.cuda_precision fp32
    # how this plan samples on CUDA (compute.cuda_sampler): static (the static-cache sampler, its step compiled
    # with CUDA graphs: rlhf_pipeline/static_sampling.py) or eager; the samplers take it from here
    sampler: str = STATIC_SAMPLER

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    @property
    def precision(self) -> str:
        if self.device.type != "cuda":
            return "fp32"
        if self.autocast_dtype is None:
            return "fp32, no TF32"
        return "bf16 autocast, fp32 weights, TF32"

    def describe(self) -> str:
        """What the stage ran on, for metrics, cards and ``rlhf lineage``: ``cpu (fp32)`` or e.g.
        ``NVIDIA H100 80GB HBM3 (bf16 autocast, fp32 weights, TF32; static-cache sampler)``."""
        if self.device.type != "cuda":
            return f"cpu ({self.precision})"
        sampler = "static-cache sampler" if self.sampler == STATIC_SAMPLER else "eager sampler"
        return f"{torch.cuda.get_device_name(self.device)} ({self.precision}; {sampler})"

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on this plan's device (no copy when it is there already)."""
        return tensor.to(self.device)


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def resolve_compute(compute, deterministic: bool = True) -> DevicePlan:
    """:func:`resolve_device` for a ``compute`` params section (rlhf_pipeline/params/compute.py), with its
    attention installed for every model the process runs (:func:`rlhf_pipeline.attention.use_attention`):
    every stage that runs a model calls this first."""
    use_attention(compute.attention)
    return resolve_device(compute.device, compute.cuda_precision, deterministic, compute.cuda_sampler)


def resolve_device(
    device: str = "auto", cuda_precision: str = "bf16", deterministic: bool = True, sampler: str = STATIC_SAMPLER
) -> DevicePlan:
    """``compute.device`` for this process: ``auto`` is CUDA (the local rank's GPU) when torch sees
    one, else the CPU; ``cuda`` without a visible GPU is a :class:`DeviceError` (exit 2) naming the
    key; ``cpu`` is the CPU even on a GPU host. On CUDA, also sets what makes its kernels
    deterministic (module docstring) before the first of them runs, unless ``deterministic`` is
    false (``ppo.deterministic``); the CPU's kernels are left as they are (see numerics.py).
    ``sampler``: how the plan samples on CUDA (:attr:`DevicePlan.sampler`)."""
    if device not in ("auto", "cpu", "cuda"):
        raise DeviceError(f"{DEVICE_KEY} is {device!r}; use auto, cpu or cuda.")
    if sampler not in CUDA_SAMPLERS:
        raise DeviceError(f"compute.cuda_sampler is {sampler!r}; use {' or '.join(CUDA_SAMPLERS)}.")
    if device == "cuda" and not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise DeviceError(
            f"{DEVICE_KEY} is 'cuda' but torch sees no CUDA device on this host (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda or 'none'}; CUDA_VISIBLE_DEVICES={visible!r}). "
            f"Set {DEVICE_KEY}: auto (the GPU when there is one, else the CPU) or cpu, or run on a GPU host."
        )
    if device == "cpu" or not torch.cuda.is_available():
        return DevicePlan(torch.device("cpu"), None, sampler)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    bf16 = cuda_precision == "bf16" and torch.cuda.is_bf16_supported()
    torch.backends.cuda.matmul.allow_tf32 = bf16
    torch.backends.cudnn.allow_tf32 = bf16
    index = local_rank()
    torch.cuda.set_device(index)
    return DevicePlan(torch.device("cuda", index), torch.bfloat16 if bf16 else None, sampler)


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (the CPU for a model without any)."""
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")
