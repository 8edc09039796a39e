"""CPU numerics: the same bytes on other x86-64 CPUs (``portable``, ``compatible``), or this host's
own fastest kernels (``native``). ``compute.cpu_numerics`` chooses; every stage that runs a model
declares it, and the stage runner pins it before the stage's first torch operation.

Why a pin is needed. torch's CPU wheel picks its kernels by the instruction set it finds, and kernels
for wider vectors add in another order: an AVX-512 host samples other tokens than an AVX2 host from
the same weights, and every output from the first sampled one on differs. What torch 2.13's CPU
wheel obeys, found by test (``bench/probe_numerics.py``; findings in ``docs/numerics.md``):

- ATen's vectorised kernels (softmax, norms, SiLU, the attention kernel, reductions) follow
  ``ATEN_CPU_CAPABILITY``, read once at the first kernel call (so setting it in the running
  process works until then; :func:`pin` checks that it took).
- MKL (every fp32 GEMM) follows ``MKL_CBWR``, read at its first call. It honours the ``AVX2`` branch
  on Intel CPUs only: on an AMD CPU it reads back ``AUTO`` and runs its Zen code path. Its
  ``COMPATIBLE`` branch is honoured on both (the one branch Intel documents as giving the same
  results on Intel and other CPUs), at 2.2x the GEMM time.
- oneDNN (torch's fp32 GELU among others) follows ``ONEDNN_MAX_CPU_ISA``.
- No variable fixes how torch splits a large reduction between threads: a 4 M-element sum gives
  other bits on 1 and 2 threads. So a pin also fixes the thread count (``compute.cpu_threads``).

So ``portable`` (the default: no cost on an AVX2 host) pins all four at AVX2: the same bytes on any
Intel CPU with AVX2 (MKL's reproducibility guarantee for one branch), and on AMD CPUs that share
MKL's Zen path; ``compatible`` also moves MKL to its COMPATIBLE branch: the same bytes on Intel and
AMD CPUs alike, GEMMs 2.2x slower.

Standard library only at import: an entry point may import this before torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rlhf_pipeline.errors import SettingsError

PORTABLE, COMPATIBLE, NATIVE = "portable", "compatible", "native"
MODES = (PORTABLE, COMPATIBLE, NATIVE)
LEVEL = "AVX2"  # every x86-64 CPU of the last decade has it (Intel Haswell 2013, AMD Zen 2017)
# what each pinning mode sets: the variable, its value, and what obeys it
_PORTABLE_ENVIRONMENT = {
    "ATEN_CPU_CAPABILITY": "avx2",  # torch's own CPU kernels
    "MKL_CBWR": "AVX2",  # MKL's conditional numerical reproducibility branch (its GEMMs); Intel CPUs only
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN's JIT kernels
}
PINNED_ENVIRONMENTS: dict[str, dict[str, str]] = {
    PORTABLE: _PORTABLE_ENVIRONMENT,
    # portable but MKL's COMPATIBLE branch, which MKL honours on every x86-64 CPU, Intel's or not
    COMPATIBLE: {**_PORTABLE_ENVIRONMENT, "MKL_CBWR": "COMPATIBLE"},
}
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# MKL's own encoding of the branch it runs (mkl_cbwr.h), to read back what it took
_MKL_BRANCHES = {0: "OFF", 1: "BRANCH_OFF", 2: "AUTO", 3: "COMPATIBLE", 10: "AVX2", 12: "AVX512"}


class NumericsError(SettingsError):
    """The host cannot run the pinned numerics (or torch ran a kernel before the pin): exit 2."""


@dataclass
class Pin:
    """What this process pinned: ``mode``, ``threads`` (None: torch's own choice), and each variable
    the user had set to another value, which the pin replaced (``overridden``: name -> theirs)."""

    mode: str
    threads: int | None
    overridden: dict[str, str] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """What a model card records. A pinning mode's record is the same on every host (so are the
        bytes); ``native`` records the host's kernels and threads, which decide its bytes."""
        if self.mode in PINNED_ENVIRONMENTS:
            variables = dict(PINNED_ENVIRONMENTS[self.mode])
            return {"mode": self.mode, "level": LEVEL, "threads": self.threads, "variables": variables}
        return {"mode": NATIVE, "capability": torch_capability(), "threads": torch_threads()}


_pinned: Pin | None = None


def pinned() -> Pin | None:
    """The pin this process applied, or None (nothing pinned: a library caller, the tests)."""
    return _pinned


def pinned_environment(mode: str, threads: int) -> dict[str, str]:
    """Every variable pinning ``mode`` sets, threads included (child processes inherit them)."""
    return {**PINNED_ENVIRONMENTS[mode], **{name: str(threads) for name in THREAD_VARIABLES}}


def overrides(environ: Mapping[str, str], mode: str, threads: int) -> dict[str, str]:
    """The variables in ``environ`` that pinning ``mode`` with ``threads`` replaces: name -> the user's value."""
    wanted = pinned_environment(mode, threads)
    return {name: environ[name] for name in wanted if name in environ and environ[name] != wanted[name]}


def pin(mode: str, threads: int | None, environ: dict[str, str] | None = None) -> Pin:
    """Apply ``mode`` to this process (and to ``environ``, by default ``os.environ``, which child
    processes inherit); print one line naming any variable of the user's that the pin replaced.

    ``portable`` and ``compatible`` set their :data:`PINNED_ENVIRONMENTS` and ``threads`` torch
    threads, then check that torch runs at :data:`LEVEL` (exit 2 otherwise: the host lacks it, or a
    kernel ran before the pin). ``native`` sets nothing but ``threads`` (when given): the host's
    kernels decide the bytes."""
    global _pinned
    environ = os.environ if environ is None else environ
    if mode not in MODES:
        raise NumericsError(f"compute.cpu_numerics: {mode!r} is not one of {', '.join(MODES)}.")
    replaced: dict[str, str] = {}
    if mode in PINNED_ENVIRONMENTS:
        if threads is None:  # the params schema refuses this combination (compute.cpu_threads)
            raise NumericsError(f"compute.cpu_numerics: {mode} needs compute.cpu_threads: a number, not null.")
        wanted = pinned_environment(mode, threads)
        replaced = overrides(environ, mode, threads)
        environ.update(wanted)
        if replaced:
            theirs = ", ".join(f"{name}={value}" for name, value in replaced.items())
            ours = ", ".join(f"{name}={wanted[name]}" for name in replaced)
            print(
                f"compute.cpu_numerics is {mode}, so it wins over your environment's {theirs} (this run uses "
                f"{ours}); to run with your own, set compute.cpu_numerics: native (its outputs are then this "
                "host's own bytes).",
                flush=True,
            )
    if threads is not None:
        _set_torch_threads(threads)
    if mode in PINNED_ENVIRONMENTS:
        _require_level(mode)
    _pinned = Pin(mode, threads, replaced)
    return _pinned


def _set_torch_threads(threads: int) -> None:
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


def torch_capability() -> str | None:
    """The kernels torch runs (``AVX2``, ``AVX512``, ``DEFAULT``...); None before torch is imported."""
    torch = sys.modules.get("torch")
    return torch.backends.cpu.get_cpu_capability() if torch is not None else None


def torch_threads() -> int | None:
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None


def host_has_avx2() -> bool | None:
    """Whether this CPU reports AVX2 (Linux's /proc/cpuinfo); None where that cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return "avx2" in line.split()
    except OSError:
        return None
    return None


def _require_level(mode: str) -> None:
    """Raise unless torch's kernels are the pinned level (torch falls back to lower kernels, silently,
    on a host without AVX2 or on a non-x86 CPU)."""
    import torch  # the pin itself is done: torch reads the variables at its first kernel call

    capability = torch.backends.cpu.get_cpu_capability()
    if capability == LEVEL:
        return
    if host_has_avx2() is False or not capability.startswith(("AVX", "DEFAULT")):
        raise NumericsError(
            f"compute.cpu_numerics: {mode} pins torch's CPU kernels to {LEVEL}, which this CPU lacks (torch runs "
            f"{capability} kernels here): its outputs could not be the bytes other machines make. Set "
            "compute.cpu_numerics: native in params.yaml to run with this CPU's own kernels (its outputs are "
            "then this machine's own, and DVC reruns every stage that declares it)."
        )
    raise NumericsError(
        f"compute.cpu_numerics: {mode} asked torch for {LEVEL} kernels, but it runs {capability}: torch reads "
        "ATEN_CPU_CAPABILITY at its first kernel call, and one ran before the pin (this is a bug of the entry "
        "point: the pin must come before any torch operation)."
    )


def mkl_branch() -> str | None:
    """The code branch MKL runs, read back from MKL itself (None where torch does not export it):
    ``AVX2`` where the pin took, ``AUTO`` on a CPU where MKL ignores the requested branch."""
    import ctypes
    from pathlib import Path

    torch = sys.modules.get("torch")
    if torch is None:
        return None
    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        get = ctypes.CDLL(str(library)).mkl_serv_cbwr_get
    except (OSError, AttributeError):
        return None
    get.restype, get.argtypes = ctypes.c_int, [ctypes.c_int]
    branch = get(1)  # MKL_CBWR_BRANCH
    return _MKL_BRANCHES.get(branch, str(branch))


def describe(record: Mapping[str, Any] | None) -> str:
    """A card's or lineage's line for a record of :meth:`Pin.record`."""
    if not record:
        return "not recorded (made before compute.cpu_numerics, or by a process that pinned none)"
    if record.get("mode") in PINNED_ENVIRONMENTS:
        variables = " ".join(f"{k}={v}" for k, v in (record.get("variables") or {}).items())
        return f"{record['mode']}: {record.get('level')} kernels, {record.get('threads')} torch threads ({variables})"
    return (
        f"native: this host's {record.get('capability')} kernels, {record.get('threads')} torch threads "
        "(the bytes are this host's own)"
    )


def host_line() -> str:
    """What this process runs now, read back from torch and MKL (one small GEMM first: MKL settles
    its branch at its first call): how a user sees whether the pin took on their CPU."""
    import torch

    torch.ones(8, 8) @ torch.ones(8, 8)
    branch = mkl_branch()
    mkl = f"MKL runs its {branch} branch" if branch else "MKL's branch cannot be read back"
    if branch == "AUTO" and os.environ.get("MKL_CBWR", "AUTO") != "AUTO":
        mkl += f" (it ignores MKL_CBWR={os.environ['MKL_CBWR']} on a CPU that is not Intel's)"
    return f"this process: torch runs {torch_capability()} kernels on {torch_threads()} threads, {mkl}"
