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

What it keeps is bounded where it does not serve. With no block mapped apart, a large freed block cannot
leave the heap, and smaller requests split it, so the next large request grows the heap instead: on Gemma
3's 262k-token vocabulary, whose logits blocks are 1.6 GB, a run of ``evaluate`` once peaked at 12.4 GB
against 6.5 GB under glibc's own settings, and a probe with the same blocks on a tiny model at 9.6 to
10.2 GB against 3.7 GB (in some runs; in others at 3.8 GB: the threads' timing decides). So a thread
checks every :data:`CHECK_SECONDS` whether the heap grew since its last look while more than
:data:`KEPT_BOUND` (2 GiB) of it was free: malloc asked the OS for more memory although it held that
much unused, so its free blocks were not serving the requests. Then it calls ``malloc_trim(0)``, which
gives every free page back (the heap's top, the holes in its middle, every thread's arena); the probe
then peaked at 5.3 to 6.1 GB. Free memory that the process takes again without the heap growing stays: a
training step that frees 2.8 GB and takes the same blocks the next step is not made to fault them in
each step, and a layout whose heap holds 3 to 4 GB of holes that its phases fill in turn (PPO with a
separate value model) is made to far less often. SmolLM2's stages keep well under the bound, so there
it never fires (each stage's last line counts the times it did).

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
# free memory the heap may hold while it grows (past it, what is free is given back): the same 2 GiB
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


def heap_bytes(info: _MallInfo2) -> int:
    """The memory malloc has taken from the OS, in use or free: every arena's heap and the blocks mapped apart."""
    return info.arena + info.hblkhd


def give_back_beyond(libc, bound: int, heap_before: int = 0, anonymous: int | None = None) -> tuple[bool, int]:
    """``malloc_trim(0)`` when malloc's heap (:func:`heap_bytes`) is larger than ``heap_before`` (its size
    when the caller last looked; 0: never) and more than ``bound`` bytes of it are free (``fordblks``).
    Returns whether it gave memory back, and the heap's size (0 when it was not read). ``anonymous``: an
    ``RssAnon`` the caller has just read, else it is read here.

    Why only when the heap grew: free memory costs something only when the process asks the OS for more
    while holding it, that is, when the free blocks did not serve a request (too small, or split by
    smaller ones). A training step that frees 2.8 GB and takes the same blocks again the next step does
    not grow the heap; giving the blocks back there only makes the next step fault them in again (the
    reward bench: 400k faults a step, ``bench/results/allocator.md``). Blocks that no longer serve
    (Gemma's 1.6 GB logits among smaller holes) make the heap grow, and that is where they go back.
    Measures that look simpler fail (``bench/results/allocator.md``):
    - ``RssAnon`` past the highest a check saw since the last give-back: a trim lowers ``RssAnon`` but
      leaves the heap's holes where they are, so it climbs back past what the trim left each time the
      process fills them again (PPO with a separate value model: about 6 give-backs and 4.1 M page
      faults an update);
    - free bytes that are resident (``RssAnon`` less what is in use) at the growth: a block just handed
      out counts as in use before its pages are written, so the look right after a growth reads too
      little, and the Gemma probe peaked at 7.5 GB instead of 5.3 to 6.1;
    - growth past the heap's size at the last give-back, or by 32 or 256 MiB or more at a look: with the
      heap no larger, the probe's sampling writes its 100 MB logits into other holes each step, and it
      peaked at up to 8.4, 8.9 and 7.7 GB.
    What this rule can still cost: after a give-back a heap may creep up a few MB at a time, and each such
    look gives its holes back again (PPO's separate layout did so in one run: 7 times in 3 updates, against
    21 under the earlier rule; in another, 0 after its warm-up update).
    While ``RssAnon`` itself is within the bound, less than the bound can be given back, so ``mallinfo2``'s
    walk over every free chunk (13 ms on a fragmented 2.6 GB heap) is skipped."""
    if anonymous is None:
        anonymous = resident_anonymous_bytes()
    if anonymous is not None and anonymous <= bound:
        return False, 0
    info = libc.mallinfo2()
    heap = heap_bytes(info)
    if heap <= heap_before or info.fordblks <= bound:
        return False, heap
    libc.malloc_trim(0)
    return True, heap


def bound_check(libc, bound: int, heap_before: int, anonymous_before: int) -> tuple[bool, int, int]:
    """One check of the bound's thread: whether it gave memory back (:func:`give_back_beyond`), the heap's
    size as this check read it (else ``heap_before``), and ``RssAnon`` now (after a give-back, what the
    trim left).

    ``anonymous_before`` is the ``RssAnon`` the last check read. A check walks ``mallinfo2`` only when
    ``RssAnon`` grew since: a heap that grew writes its new pages sooner or later, and the check that
    sees them finds the heap larger than the last walk did. So a process at its size, however much it
    keeps, reads ``/proc`` once a check and nothing more; one more read follows a give-back."""
    anonymous = resident_anonymous_bytes()
    if anonymous is not None and anonymous <= anonymous_before:
        return False, heap_before, anonymous
    gave_back, heap = give_back_beyond(libc, bound, heap_before, anonymous)
    heap = heap or heap_before  # within the bound nothing was read
    if not gave_back:
        return False, heap, anonymous or 0
    return True, heap, resident_anonymous_bytes() or 0


def _bound_what_is_kept(libc, bound: int, seconds: float) -> None:
    global _given_back
    heap_before = anonymous = 0  # the heap's size at the last walk; RssAnon at the last check
    while True:
        time.sleep(seconds)
        gave_back, heap_before, anonymous = bound_check(libc, bound, heap_before, anonymous)
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
            f"all free memory given back when the heap grows holding over {KEPT_BOUND >> 30} GiB free; "
            f"{ENVIRONMENT_VARIABLE}=system: glibc's own settings)"
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
