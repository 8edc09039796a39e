"""Multi-process set-up, in one place: the process group that `accelerate launch` or `torchrun`
describes in the environment (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``), and the few collective
operations PPO needs. One process (the default) makes every function here a no-op.

Not yet on ``accelerate.Accelerator``: a DeepSpeed or FSDP configuration given to `accelerate
launch` is not honoured (plain DDP, full optimizer state on every rank).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def launched_world_size() -> int:
    """The number of processes the launcher started (1 when run directly)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def init_process_group(device: torch.device) -> bool:
    """Join the launcher's process group (nccl on CUDA, gloo on CPU); True if this is rank 0."""
    if launched_world_size() > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return rank() == 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if world_size() > 1 else 0


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def mean_over_processes(value: torch.Tensor) -> float:
    """The mean of a scalar tensor over all processes (its value with one process)."""
    if world_size() > 1:
        value = value.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= world_size()
    return value.item()


def data_parallel(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``module`` wrapped for gradient all-reduce when several processes train it."""
    if world_size() == 1:
        return module
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)
