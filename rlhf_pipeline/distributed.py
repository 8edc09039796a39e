"""Several processes training one model, on ``accelerate``: the one place that knows about them.

`accelerate launch` (or `torchrun`) starts the processes and describes them and the user's
configuration (DDP, FSDP, DeepSpeed) in the environment; :func:`make_accelerator` turns that into
an ``accelerate.Accelerator`` after refusing what the training code cannot honour. One process
(the default) makes every helper here a plain local operation.

Sizes stay global (as in lm-human-preference-details): every process works on its contiguous
share of a batch, and :func:`gather_rows` reassembles the batch in its one-process order, so a
run on N processes takes the same steps as one process over the same global batch.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch

from rlhf_pipeline.decoding import share_rows
from rlhf_pipeline.errors import LaunchConfigError, LostProcessError, PipelineError
from rlhf_pipeline.functional import non_finite_tensors


def launched_world_size() -> int:
    """The number of processes the launcher started (1 when run directly)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def _flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def deepspeed_zero_stage() -> int | None:
    """The ZeRO stage of the DeepSpeed configuration `accelerate launch` passed on (None: no DeepSpeed)."""
    if not _flag("ACCELERATE_USE_DEEPSPEED"):
        return None
    config_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if config_file and Path(config_file).is_file():
        stage = json.loads(Path(config_file).read_text()).get("zero_optimization", {}).get("stage", 0)
        return int(stage)
    return int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))


def refuse_unsupported(device: torch.device, trunk_split: bool, stage: str, lora: bool = False) -> None:
    """Stop before anything loads when the launcher's configuration cannot be honoured as asked
    (:class:`LaunchConfigError`, exit code 2: retrying cannot fix it)."""
    if lora and launched_world_size() > 1:
        raise LaunchConfigError(
            f"{stage}: ppo.lora trains on one process only (the adapter is not wrapped for DDP or sharded by FSDP "
            f"here), and `accelerate launch` started {launched_world_size()}. Run `dvc repro` directly, or set "
            "ppo.lora: null for a full fine-tune on several processes."
        )
    zero = deepspeed_zero_stage()
    if zero is not None and device.type != "cuda":
        raise LaunchConfigError(
            f"{stage}: `accelerate launch` asked for DeepSpeed (ZeRO stage {zero}), but training runs on "
            f"{device.type}: accelerate uses DeepSpeed only on GPUs and would otherwise run without it. Launch "
            "without the DeepSpeed configuration (plain DDP, or --use_fsdp --fsdp_version 2) or on a GPU machine."
        )
    if zero == 3 and trunk_split:
        raise LaunchConfigError(
            f"{stage}: DeepSpeed ZeRO-3 cannot be combined with the trunk split (freeze_layers > 0 on a "
            "supported architecture): the split runs the policy's frozen lower blocks only while sampling and "
            "the upper blocks alone from their cached activation in training, outside the module order ZeRO-3 "
            "gathers its partitioned weights in. Use ZeRO-2 or FSDP (--use_fsdp --fsdp_version 2), or set "
            "freeze_layers: 0."
        )
    if _flag("ACCELERATE_USE_FSDP") and os.environ.get("FSDP_VERSION", "1") != "2":
        raise LaunchConfigError(
            f"{stage}: `accelerate launch --use_fsdp` chose FSDP version {os.environ.get('FSDP_VERSION', '1')}; "
            "this project trains with part of the model frozen, which FSDP 1's flattened parameters cannot "
            "hold in one unit, and is tested on FSDP 2 only. Add --fsdp_version 2 (or fsdp_version: 2 in the "
            "accelerate config)."
        )


# this process's process-group timeout and the key that set it, for :func:`lost_processes_reported`'s
# message: a process has one default process group (accelerate's PartialState is a process-wide
# singleton too), so the timeout is said once, to :func:`make_accelerator`
_group_timeout: tuple[str, float] = ("the process group's timeout", 1800.0)


def make_accelerator(
    device: torch.device,
    trunk_split: bool = False,
    stage: str = "training",
    lora: bool = False,
    collective_timeout_s: float = 1800.0,
    timeout_key: str = "the process group's timeout",
):
    """The ``Accelerator`` for the launcher's processes and configuration (one process: a plain one).

    ``collective_timeout_s`` is the process group's timeout (set by the params key ``timeout_key``,
    which a lost process's message names): how long a collective waits for the other processes
    (with gloo, every collective; with NCCL, its watchdog's limit). The process state is made first
    with it, as accelerate documents for ``init_process_group`` arguments (``InitProcessGroupKwargs``
    would drop a value equal to its own NCCL default of 600 s, and gloo would then wait torch's 1800 s).

    accelerate (1.15) turns FSDP on only for accelerator devices: on CPU processes an FSDP
    configuration would silently give DDP. Here it is honoured on CPU too (gloo), which is how
    the tests run FSDP on two CPU processes.
    """
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    global _group_timeout
    refuse_unsupported(device, trunk_split, stage, lora)
    _group_timeout = (timeout_key, collective_timeout_s)
    PartialState(cpu=device.type == "cpu", timeout=timedelta(seconds=collective_timeout_s))
    accelerator = Accelerator(cpu=device.type == "cpu")
    if _flag("ACCELERATE_USE_FSDP") and accelerator.distributed_type == DistributedType.MULTI_CPU:
        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()  # read from the launcher's environment
        # both shared states: accelerate copies the process-level one into the other on every AcceleratorState()
        PartialState().distributed_type = accelerator.state.distributed_type = DistributedType.FSDP
    if launched_world_size() != accelerator.num_processes:
        raise PipelineError(
            f"{stage}: the launcher started {launched_world_size()} processes but they did not join one "
            f"process group (accelerate sees {accelerator.num_processes}); each would train and write alone."
        )
    return accelerator


# gloo's own words when a peer is gone: its socket closed (the process died) or a collective ran past
# the process group's timeout (the process or its machine stopped answering); torch's DistError covers
# the store, NCCL and the network where torch raises its own types
_GLOO_LOST_PEER = re.compile(r"Connection closed by peer|Connection reset by peer|Timed out waiting \d+ms")


@contextmanager
def lost_processes_reported(accelerator, stage: str, resume: str):
    """Inside the block, a collective that fails because another process is gone (killed, crashed,
    or silent past the timeout :func:`make_accelerator` was given) stops this process with
    :class:`LostProcessError`, whose message says what happened and how to go on (``resume``),
    instead of gloo's traceback.
    One process: nothing to lose, errors pass unchanged."""
    try:
        yield
    except (RuntimeError, torch.distributed.DistError) as error:
        if accelerator.num_processes == 1:
            raise
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if not (isinstance(error, torch.distributed.DistError) or _GLOO_LOST_PEER.search(reason)):
            raise
        if "Timed out" in reason or "timeout" in reason.lower():
            timeout_key, timeout_s = _group_timeout
            what = (
                f"did not answer within {timeout_key} = {timeout_s:g} s (it hangs, or its machine or network is down)"
            )
        else:
            what = "closed its connection (it crashed or was killed, or its machine went down)"
        raise LostProcessError(
            f"{stage}: process {accelerator.process_index} of {accelerator.num_processes} stopped because another "
            f"process {what}. {resume} The process group's own words: {reason}"
        ) from error


def is_fsdp(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def share(accelerator, rows: int) -> slice:
    """This process's contiguous share of ``rows`` batch rows (rows must split evenly)."""
    count = accelerator.num_processes
    return share_rows((accelerator.process_index, count), rows // count)


def gather_rows(accelerator, tensor: torch.Tensor) -> torch.Tensor:
    """Every process's rows, concatenated in process order (the one-process batch, with :func:`share`)."""
    if accelerator.num_processes == 1:
        return tensor
    if tensor.dtype == torch.bool:  # gloo cannot gather bools
        return accelerator.gather(tensor.to(torch.uint8)).bool()
    return accelerator.gather(tensor.contiguous())


def sum_over_processes(accelerator, values: torch.Tensor) -> torch.Tensor:
    """Element-wise sum of ``values`` over processes (``values`` with one process)."""
    return values if accelerator.num_processes == 1 else accelerator.reduce(values.clone(), reduction="sum")


def any_process(accelerator, flag: bool) -> bool:
    """True on every process when ``flag`` is true on any: the processes decide together, so none
    is left waiting in a collective for one that stopped."""
    return bool(sum_over_processes(accelerator, torch.tensor([float(flag)], device=accelerator.device)).item())


@contextmanager
def full_weights(accelerator, module: torch.nn.Module):
    """Inside the block ``module``'s parameters are whole on every process (FSDP shards them
    between forwards), so code that calls its submodules directly (the sampler) can run."""
    if not is_fsdp(accelerator):
        yield module
        return
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    # FSDP finds its root on the root's first forward; before that, a block called directly (the
    # sampler runs the blocks, not the root) would take itself for the root and break the next forward
    units[0]._get_fsdp_state()._lazy_init()
    for unit in units:
        unit.unshard()
    try:
        yield module
    finally:
        for unit in units:
            unit.reshard()


def whole_model(accelerator, module: torch.nn.Module, rebuild):
    """``module`` with its whole trained weights on process 0, None on the others (every process must
    call it). FSDP leaves each process a shard: the weights are gathered into ``rebuild()``, a fresh
    module of the same structure; otherwise ``module`` itself already holds them."""
    if not is_fsdp(accelerator):
        return module if accelerator.is_main_process else None
    state = full_state(module)
    if not accelerator.is_main_process:
        return None
    fresh = rebuild()
    fresh.load_state_dict(state)
    return fresh.eval()


def _options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def trainable_names(module: torch.nn.Module) -> set[str]:
    """The names of ``module``'s parameters that train (what a checkpoint keeps)."""
    return {name for name, parameter in module.named_parameters() if parameter.requires_grad}


def _kept(module: torch.nn.Module, state: dict[str, torch.Tensor], trainable_only: bool) -> dict[str, torch.Tensor]:
    """``state``, or with ``trainable_only`` its entries for ``module``'s parameters that train."""
    if not trainable_only:
        return state
    names = trainable_names(module)
    return {name: tensor for name, tensor in state.items() if name in names}


def full_state(module: torch.nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """``module``'s whole (unsharded) state on CPU: on process 0; every process must call it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(module, options=_options(cpu_offload=True))
    return {k: v.contiguous() for k, v in _kept(module, state, trainable_only).items()}


def full_state_copy(module: torch.nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """A copy of ``module``'s whole (unsharded) state on CPU, on every process (each gathers it), which
    :func:`load_full_state` puts back later, whatever training did to the weights in between."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(module, options=_options())
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in _kept(module, state, trainable_only).items()}


def load_full_state(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a whole state (e.g. :func:`full_state`'s, on every process) into ``module``, sharded or not."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(module, state, options=_options(strict=False))


def full_optimizer_state(module: torch.nn.Module, optimizer) -> dict:
    """The optimizer's whole state keyed by parameter name: on process 0; every process must call it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(module, optimizer, options=_options(cpu_offload=True))


def load_full_optimizer_state(module: torch.nn.Module, optimizer, state: dict) -> None:
    """Load what :func:`full_optimizer_state` returned. torch's loader hands each param group's
    tuples (Adam's ``betas``) back as lists; they are put back as the optimizer had them, or a
    resumed run would save a training state of other bytes than an uninterrupted one."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    tuples = [{key for key, value in group.items() if isinstance(value, tuple)} for group in optimizer.param_groups]
    set_optimizer_state_dict(module, optimizer, state, options=_options())
    for group, keys in zip(optimizer.param_groups, tuples):
        for key in keys:
            group[key] = tuple(group[key])


def on_main_process(accelerator, action, what: str) -> None:
    """Run ``action`` on process 0 only, the others waiting; if it fails every process raises, so
    none is left waiting in a collective for a process that has stopped."""
    error = None
    if accelerator.is_main_process:
        try:
            action()
        except Exception as caught:  # re-raised below, once the others know
            error = caught
    failed = any_process(accelerator, error is not None)
    if error is not None:
        raise error
    if failed:
        raise PipelineError(f"Process 0 failed to {what} (its error is above); this process stops too.")


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor FSDP shards (the tensor itself otherwise)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def non_finite_gradients(accelerator, module: torch.nn.Module) -> list[str]:
    """The parameters of ``module`` whose gradient is not finite here, ``["on another process"]`` when
    only another process has one, ``[]`` when every process's gradient is finite (one all-reduce:
    all processes get the same verdict, so they stop together)."""
    grads = {name: local_part(p.grad) for name, p in module.named_parameters() if p.grad is not None}
    here = non_finite_tensors(grads)
    return here or (["on another process"] if any_process(accelerator, bool(here)) else [])
