"""glibc's malloc, set for training and sampling: memory a step frees stays in the process for the next step.

Why. A training step frees its activations and gradients and allocates them again the next step, and
a decoding step frees and reallocates its (rows, vocabulary) logits. With glibc's defaults a block over
the mmap threshold (at most 32 MiB) is mapped apart and goes back to the OS when freed, and the free top
of the heap goes back once it passes the trim threshold (at most 64 MiB); the next step's first write
to those pages then faults, and the kernel zeroes each 4 KiB page before handing it over. On this
project's 2-core machine the reward model's training step (``bench/reward_throughput.py``, SmolLM2-135M's
shapes) took 30,000 to 100,000 minor page faults a step, 0.15 to 0.75 s of system time; one sampling
call of 256 rows (each step's logits are 50 MB) about 650,000. This module maps no block apart (every
block comes from the heap, whatever its size) and trims the heap only once 2 GiB lies free at its top,
so the blocks a step frees serve the next one; findings and timings in ``bench/results/allocator.md``.

It changes no byte: where a block lives never changes what a kernel computes (torch aligns every CPU
block to 64 bytes either way). It costs memory: the process keeps what it freed until it exits, and
since a large freed block cannot go back, the heap fragments and the peak itself can rise (seed 4's
``evaluate`` stage: 2.98 GB against 2.69 GB with a 32 MiB mmap threshold, same inputs, run alone).

Where it applies: glibc on Linux. Elsewhere (macOS, musl), when ``GLIBC_TUNABLES`` already sets a
``glibc.malloc.*`` key (the user's own settings win) or with ``RLHF_MALLOC=system``, nothing is
changed. Standard library only: the stage runner and the benchmarks call it before any model loads.

It also reads the process's own peak memory (:func:`peak_rss_mb`), the figure each stage's log line gives.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping

from rlhf_pipeline.errors import SettingsError

ENVIRONMENT_VARIABLE = "RLHF_MALLOC"
KEEP, SYSTEM = "keep", "system"
# mallopt's parameters (glibc's malloc.h) and the values set
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
# No block mapped apart: a threshold cannot do it, since glibc takes at most 32 MiB for one on 64-bit
# hosts and a step's largest blocks are bigger (the embedding's gradient, 113 MB; 256 rows of logits,
# 50 MB). A request the heap cannot grow to still gets a mapping: glibc falls back to one itself.
MMAP_MAX = 0
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes a C int: 2 GiB is the most it can say

_kept = False


def chosen(environ: Mapping[str, str]) -> str:
    """``RLHF_MALLOC``'s value: ``keep`` (the default) or ``system`` (glibc's own behaviour)."""
    value = environ.get(ENVIRONMENT_VARIABLE, KEEP)
    if value not in (KEEP, SYSTEM):
        raise SettingsError(
            f"{ENVIRONMENT_VARIABLE}={value!r} is not one of {KEEP!r} (memory a training step frees stays in the "
            f"process for the next step; the default) or {SYSTEM!r} (glibc's own malloc settings). Unset it or "
            "set one of the two."
        )
    return value


def glibc():
    """This process's C library when it is glibc (it has ``gnu_get_libc_version``), else None."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc


def keep_freed_memory(environ: Mapping[str, str] | None = None) -> bool:
    """Set glibc's malloc so that freed blocks stay in the process (see the module's docstring);
    True when it did, False where it leaves malloc alone (not glibc, the user's ``GLIBC_TUNABLES``
    malloc keys, ``RLHF_MALLOC=system``). Calling it again changes nothing more."""
    global _kept
    environ = os.environ if environ is None else environ
    if chosen(environ) == SYSTEM or "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return False
    libc = glibc()
    if libc is None:
        return False
    # mallopt returns 1 when it took the value; a glibc that refuses one keeps its own behaviour for it
    took_mmap = libc.mallopt(M_MMAP_MAX, MMAP_MAX) == 1
    took_trim = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    _kept = took_mmap and took_trim
    return _kept


def describe() -> str:
    """One line for a report: what this process's malloc does with freed memory."""
    if _kept:
        return (
            f"glibc's malloc keeps what the process frees (no block mapped apart: mmap max {MMAP_MAX}; trim beyond "
            f"{(TRIM_THRESHOLD + 1) >> 30} GiB; {ENVIRONMENT_VARIABLE}=system: glibc's own settings)"
        )
    return "malloc as the C library sets it"


def peak_rss_mb() -> float:
    """This process's own peak resident memory so far, in MB: Linux's ``VmHWM``. Not ``ru_maxrss``, which
    on Linux starts from the high-water mark of the process that started this one (it carries over
    across fork and exec): a check run under a pytest worker holding 1 GB read 1,029 MB for its own
    0.4 GB. Elsewhere, ``ru_maxrss`` (bytes on macOS, KiB on the BSDs)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration, ValueError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024
