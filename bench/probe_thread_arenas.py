"""Probe: does malloc keep what a thread other than the main one frees, under the stages' settings?

glibc gives each thread that allocates an arena of its own (up to 8 per core), made of 64 MiB heaps: a
request of up to 64 MiB from a second thread is served there, not from the main arena's holes. The stages'
settings (``rlhf_pipeline.allocator``: no block mapped apart, a 2 GiB trim threshold) keep what the main
thread frees; the question is whether they keep a second thread's blocks too, and what the bound on kept
memory (2 GiB) does when one arena holds the free memory and another grows. The reward bench met this when
it ran its two trainers on two threads of one process (2026-11-30: 400k to 630k faults a step).

The probe, in this process with the stages' settings:
1. the main thread writes ``--holes-gb`` of 100 MB blocks, each followed by a 1 MB block it keeps, and frees
   the large ones: free holes in the main arena, not at its top;
2. a second thread runs ``--steps`` steps, each writing 40 blocks of 5 MB and freeing them, then pausing for
   two of the bound's checks;
3. with ``--same-thread`` step 2 runs on the main thread instead.

It prints each step's minor faults and the bound's give-backs so far. What it showed (``allocator.md``,
2026-11-30): on the main thread the steps fault nothing after the first give-back's refill; on a second
thread every step faults in 130 to 200 MB again with no further give-back, since glibc unmaps a thread
arena's heap once all of it is free, whatever the trim threshold. The stages compute on their main thread.

Usage::

    .venv/bin/python bench/probe_thread_arenas.py [--holes-gb 3] [--steps 6] [--same-thread]
"""

from __future__ import annotations

import argparse
import ctypes
import resource
import threading
import time

from rlhf_pipeline import allocator

BLOCK = 100 * 10**6
SMALL = 5 * 10**6


def written(libc, size: int) -> int:
    """A malloc'd block of ``size`` bytes with every page written."""
    address = libc.malloc(size)
    ctypes.memset(address, 1, size)
    return address


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--holes-gb", type=float, default=3.0)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--same-thread", action="store_true")
    args = parser.parse_args()
    print("malloc:", allocator.describe() if allocator.keep_freed_memory() else "glibc's own settings")
    libc = allocator.glibc()
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]

    kept, holes = [], []
    for _ in range(int(args.holes_gb * 10**9 / BLOCK)):
        holes.append(written(libc, BLOCK))
        kept.append(written(libc, 10**6))
    for address in holes:
        libc.free(address)
    free = libc.mallinfo2().fordblks
    print(f"main arena: {len(holes) * BLOCK / 1e9:.1f} GB of holes freed; malloc's free bytes now {free / 1e9:.2f} GB")

    rows = []

    def steps() -> None:
        for step in range(args.steps):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            blocks = [written(libc, SMALL) for _ in range(40)]
            for address in blocks:
                libc.free(address)
            time.sleep(2 * allocator.CHECK_SECONDS + 0.2)  # let the bound's thread look at what the step left
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            rows.append((step + 1, faults, allocator.times_given_back()))

    if args.same_thread:
        steps()
    else:
        worker = threading.Thread(target=steps)
        worker.start()
        worker.join()
    where = "the main thread" if args.same_thread else "a second thread"
    print(f"steps of 40 blocks of 5 MB written and freed on {where}:")
    print("step  minor faults  give-backs so far")
    for step, faults, given_back in rows:
        print(f"{step:>4}  {faults:>12}  {str(given_back):>17}")


if __name__ == "__main__":
    main()
