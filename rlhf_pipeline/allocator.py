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
block to 64 bytes either way).

It keeps at most :data:`KEPT_BOUND` (2 GiB) of freed memory resident. With no block mapped apart, a
large freed block cannot leave the heap, and smaller requests split it, so the next large request
grows the heap instead: on Gemma 3's 262k-token vocabulary, whose logits blocks are 1.6 GB, a run of
``evaluate`` once peaked at 12.4 GB against 6.5 GB under glibc's own settings, and a probe with the
same blocks on a tiny model at 9.8 GB against 3.7 GB. So a thread checks every
:data:`CHECK_SECONDS` how much anonymous resident memory malloc holds but does not hand out, and past
the bound, when the process has grown past the largest it has been, calls ``malloc_trim(0)``, which
gives every freed page back (the heap's top, the holes in its middle, every thread's arena); the probe
then peaked at 5.4 GB. Kept memory that does not make the process larger stays: a training step that
frees 2.8 GB and takes the same blocks again the next step is not made to fault them in each step.
SmolLM2's stages keep well under the bound, so there it never fires (each stage's last line counts
the times it did).

Where it applies: glibc 2.33 or later (``mallinfo2``) on Linux. Elsewhere (macOS, musl, an older
glibc), when ``GLIBC_TUNABLES`` already sets a ``glibc.malloc.*`` key (the user's own settings win) or
with ``RLHF_MALLOC=system``, nothing is changed. Standard library only: the stage runner and the
benchmarks call it before any model loads.

It also reads the process's own peak memory (:func:`peak_rss_mb`), the figure each stage's log line gives.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
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
# freed memory kept resident anywhere in the process, not only at the heap's top: the same 2 GiB
KEPT_BOUND = 2**31
CHECK_SECONDS = 0.25  # a 1.6 GB logits block takes longer than this to compute

_kept = False
_trim_set = False  # whether mallopt took TRIM_THRESHOLD; without it glibc trims the heap's top as it would
_given_back = 0  # how many times the bound was passed and the freed memory given back


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (malloc.h): byte counts over all arenas, as ``size_t``."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


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
    """This process's C library when it is glibc 2.33 or later (it has ``gnu_get_libc_version``, and
    ``mallinfo2`` and ``malloc_trim`` to bound what is kept), else None."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None)
    if not all(hasattr(libc, name) for name in ("gnu_get_libc_version", "mallopt", "mallinfo2", "malloc_trim")):
        return None  # not glibc, or one older than 2.33: no mallinfo2 to bound what is kept
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    libc.mallinfo2.argtypes = []
    libc.mallinfo2.restype = _MallInfo2
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return libc


def _status_kib(field: str) -> int | None:
    """One ``kB`` field of Linux's ``/proc/self/status`` (``RssAnon``, ``VmHWM``); None where there is none."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(f"{field}:"))
    except (OSError, StopIteration, ValueError):
        return None


def resident_anonymous_bytes() -> int | None:
    """This process's resident anonymous memory (Linux's ``RssAnon``): the malloc heaps and mappings, the
    interpreter's own arenas, thread stacks; not the pages of mapped files such as safetensors weights."""
    kib = _status_kib("RssAnon")
    return None if kib is None else kib * 1024


def kept_bytes(libc, anonymous: int | None = None) -> int:
    """Resident anonymous memory that malloc holds but has not handed out: ``RssAnon`` less the bytes in
    use (heap chunks, ``uordblks``, and blocks mapped apart, ``hblkhd``). It counts the interpreter's
    own arenas and the threads' stacks too, a few hundred MB at most; never below 0. ``anonymous``: an
    ``RssAnon`` the caller has just read (:func:`resident_anonymous_bytes`), else it is read here."""
    info = libc.mallinfo2()
    if anonymous is None:
        anonymous = resident_anonymous_bytes() or 0
    return max(0, anonymous - info.uordblks - info.hblkhd)


def give_back_beyond(libc, bound: int, peak: int = 0, anonymous: int | None = None) -> bool:
    """``malloc_trim(0)`` when more than ``bound`` bytes are kept (:func:`kept_bytes`) and ``RssAnon`` is
    above ``peak`` (the highest the caller has seen); True when it did. ``anonymous``: an ``RssAnon`` the
    caller has just read, else it is read here.

    Why only above the peak: what is kept costs memory only when it makes the process larger than it has
    been. A training step that frees 2.8 GB and takes the same blocks again the next step keeps its size;
    giving the blocks back there only makes the next step fault them in again (the reward bench: 400k
    faults a step, ``bench/results/allocator.md``). Blocks that no longer serve (Gemma's 1.6 GB logits
    among smaller holes) make the heap grow past its peak, and that is where they go back.
    While ``RssAnon`` itself is within the bound, what is kept cannot pass it, so ``mallinfo2``'s walk over
    every free chunk (2 to 7 ms in SmolLM2's ``evaluate``) is skipped."""
    if anonymous is None:
        anonymous = resident_anonymous_bytes()
    if anonymous is not None and (anonymous <= bound or anonymous <= peak):
        return False
    if kept_bytes(libc, anonymous) <= bound:  # the same RssAnon: /proc is read once a check
        return False
    libc.malloc_trim(0)
    return True


def bound_check(libc, bound: int, peak: int) -> tuple[bool, int]:
    """One check of the bound's thread: whether it gave memory back (:func:`give_back_beyond`), and the
    highest ``RssAnon`` seen so far (after a give-back, what the trim left). ``/proc`` is read once a
    check, and once more after a give-back."""
    anonymous = resident_anonymous_bytes()
    gave_back = give_back_beyond(libc, bound, peak, anonymous)
    if gave_back:
        anonymous = resident_anonymous_bytes()
    return gave_back, max(peak, anonymous or 0)


def _bound_what_is_kept(libc, bound: int, seconds: float) -> None:
    global _given_back
    peak = 0  # the highest RssAnon a check has seen: only growth past it can be what is kept
    while True:
        time.sleep(seconds)
        gave_back, peak = bound_check(libc, bound, peak)
        _given_back += gave_back


def times_given_back() -> int | None:
    """How many times this process passed :data:`KEPT_BOUND` and gave its freed memory back; None when
    malloc is left as the C library sets it."""
    return _given_back if _kept else None


def keep_freed_memory(environ: Mapping[str, str] | None = None) -> bool:
    """Set glibc's malloc so that freed blocks stay in the process (see the module's docstring);
    True when it did, False where it leaves malloc alone (not glibc, the user's ``GLIBC_TUNABLES``
    malloc keys, ``RLHF_MALLOC=system``). Calling it again changes nothing more."""
    global _kept, _trim_set
    environ = os.environ if environ is None else environ
    if chosen(environ) == SYSTEM or "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return False
    if _kept:
        return True
    libc = glibc()
    if libc is None or resident_anonymous_bytes() is None:
        return False  # without both, what is kept could not be bounded
    # mallopt returns 1 when it took the value; a glibc that refuses one keeps its own behaviour for it
    # No block mapped apart is what keeps freed blocks, whatever the trim threshold: the heap's top is kept
    # (and bounded) only when that took, and the bound runs whenever it did.
    _kept = libc.mallopt(M_MMAP_MAX, MMAP_MAX) == 1
    _trim_set = _kept and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if _kept:  # a daemon thread: it never holds the interpreter's exit, and sleeps between checks
        bound = threading.Thread(
            target=_bound_what_is_kept, args=(libc, KEPT_BOUND, CHECK_SECONDS), name="malloc-bound", daemon=True
        )
        bound.start()
    return _kept


def describe() -> str:
    """One line for a report: what this process's malloc does with freed memory."""
    if _kept:
        trim = f"trim beyond {(TRIM_THRESHOLD + 1) >> 30} GiB" if _trim_set else "glibc's own trim threshold"
        return (
            f"glibc's malloc keeps what the process frees (no block mapped apart: mmap max {MMAP_MAX}; {trim}; "
            f"all given back past {KEPT_BOUND >> 30} GiB kept; {ENVIRONMENT_VARIABLE}=system: glibc's own settings)"
        )
    return "malloc as the C library sets it"


def peak_rss_mb() -> float:
    """This process's own peak resident memory so far, in MB: Linux's ``VmHWM``. Not ``ru_maxrss``, which
    on Linux starts from the high-water mark of the process that started this one (it carries over
    across fork and exec): a check run under a pytest worker holding 1 GB read 1,029 MB for its own
    0.4 GB. Elsewhere, ``ru_maxrss`` (bytes on macOS, KiB on the BSDs)."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib / 1024
    import resource  # Unix only: imported where it is needed, after Linux's own figure

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024
