"""glibc's malloc keeps the memory a training step frees (rlhf_pipeline/allocator.py)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlhf_pipeline import allocator
from rlhf_pipeline.errors import SettingsError
from rlhf_pipeline.params import StageParams
from rlhf_pipeline.runner import run_stage

# A step's pattern: blocks written, then all freed, three times over. glibc's defaults hand the
# freed memory back to the OS each time, so every later round faults its pages in again: 40 blocks of
# 4 MiB (activations) through the trimmed heap, 3 of 48 MiB (a decoding step's logits, the
# embedding's gradient) through mappings of their own, which no mmap threshold glibc accepts avoids.
ROUNDS = """
import ctypes, json, resource, sys
from rlhf_pipeline import allocator
kept = allocator.keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
count, size = int(sys.argv[1]), int(sys.argv[2]) * 2**20

def one_round():
    blocks = [libc.malloc(size) for _ in range(count)]
    for block in blocks:
        ctypes.memset(block, 1, size)
    for block in blocks:
        libc.free(block)

one_round()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
one_round()
one_round()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"kept": kept, "faults": faults, "line": allocator.describe()}))
"""


def run_child(script: str, *args: str, malloc: str = allocator.KEEP) -> dict:
    """``script`` in a fresh Python under ``RLHF_MALLOC=malloc``; the JSON it prints."""
    # this checkout's package, whichever the environment's install points at
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "RLHF_MALLOC": malloc}
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def later_rounds(malloc: str, count: int, mib: int) -> dict:
    return run_child(ROUNDS, str(count), str(mib), malloc=malloc)


@pytest.mark.skipif(allocator.glibc() is None, reason="glibc's malloc only: this C library is not glibc")
@pytest.mark.parametrize(("count", "mib"), [(40, 4), (3, 48)], ids=["40 blocks of 4 MiB", "3 blocks of 48 MiB"])
def test_freed_blocks_serve_the_next_round_instead_of_faulting_in_again(count, mib):
    system, keep = later_rounds(allocator.SYSTEM, count, mib), later_rounds(allocator.KEEP, count, mib)
    assert system["kept"] is False and keep["kept"] is True
    pages = 2 * count * mib * 2**20 // 4096  # what two rounds write
    assert system["faults"] > pages // 2, system  # glibc's own settings gave the rounds' memory back
    assert keep["faults"] < pages // 20, keep
    # a report's memory line says the values mallopt took, and nothing where malloc was left alone
    assert "no block mapped apart: mmap max 0; trim beyond 2 GiB; all given back past 2 GiB kept" in keep["line"]
    assert system["line"] == "malloc as the C library sets it"


# Freed memory the heap cannot give back by trimming its top: 4 blocks of 48 MiB written, each followed by a
# small block still in use, then the large ones freed. The thread that bounds what is kept runs at a 64 MiB
# bound here (2 GiB in the stages), either on its own or called once by hand.
HOLES = """
import ctypes, json, sys, time
from rlhf_pipeline import allocator
allocator.KEPT_BOUND = 64 << 20
by_thread = sys.argv[1] == "thread"
allocator.CHECK_SECONDS = 0.05 if by_thread else 3600  # by hand: the thread must not act first
kept = allocator.keep_freed_memory()
libc = allocator.glibc()
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 48 << 20
large, small = [], []
for _ in range(4):
    large.append(libc.malloc(size))
    ctypes.memset(large[-1], 1, size)
    small.append(libc.malloc(1 << 20))  # from the top, right after it: the hole cannot coalesce
if by_thread:
    time.sleep(0.2)  # the thread sees the blocks in use: the process's peak
for block in large:
    libc.free(block)
held = allocator.kept_bytes(libc)
plateau = None
if by_thread:
    time.sleep(0.5)  # the process is no larger than it has been: what it keeps stays
    plateau = [allocator.times_given_back(), allocator.kept_bytes(libc)]
    grow = libc.malloc(256 << 20)  # too large for the holes: the process grows past its peak
    ctypes.memset(grow, 1, 256 << 20)
    time.sleep(0.5)
    given = None
else:
    at_peak = allocator.resident_anonymous_bytes()
    given = [
        allocator.give_back_beyond(libc, 1 << 40),
        allocator.give_back_beyond(libc, allocator.KEPT_BOUND, at_peak),
        allocator.give_back_beyond(libc, allocator.KEPT_BOUND),
    ]
print(json.dumps({"kept": kept, "held": held, "after": allocator.kept_bytes(libc), "given": given,
                  "times": allocator.times_given_back(), "plateau": plateau}))
"""


@pytest.mark.skipif(allocator.glibc() is None, reason="glibc 2.33 or later only: this C library is not one")
@pytest.mark.parametrize("how", ["by hand", "thread"])
def test_freed_memory_past_the_bound_is_given_back(how):
    """What keeping costs is bounded: freed blocks held in the heap's middle (192 MiB, past a 64 MiB
    bound) are given back by malloc_trim, by one check or by the stage's thread, once the process grows
    past its peak; under the bound, or while it is no larger than it has been, they stay for reuse."""
    result = run_child(HOLES, how)
    assert result["kept"] is True
    assert result["held"] > 180 << 20, result  # the four freed blocks stayed resident
    assert result["after"] < 64 << 20, result  # given back
    if how == "by hand":
        # a 1 TiB bound, then the process at its peak: nothing to do; then past the bound with no peak: trimmed
        assert result["given"] == [False, False, True] and result["times"] == 0, result
    else:
        times_at_plateau, kept_at_plateau = result["plateau"]
        assert times_at_plateau == 0 and kept_at_plateau > 180 << 20, result  # kept while no larger than before
        assert result["times"] >= 1, result  # given back once the process grew past its peak


# A glibc that refuses one of the two mallopt values. Refusing M_TRIM_THRESHOLD: blocks are still kept (none
# is mapped apart), so what is kept must still be bounded, and the report must not claim the trim threshold.
# Refusing M_MMAP_MAX: nothing is kept, so the trim threshold must not be raised either.
ONE_REFUSED = """
import json, sys, threading
from rlhf_pipeline import allocator
real = allocator.glibc()
refused = getattr(allocator, sys.argv[1])
asked = []

class OneRefused:
    def __getattr__(self, name):
        return getattr(real, name)

    def mallopt(self, param, value):
        asked.append(param)
        return 0 if param == refused else real.mallopt(param, value)

allocator.glibc = OneRefused
kept = allocator.keep_freed_memory()
threads = [thread.name for thread in threading.enumerate()]
line, times = allocator.describe(), allocator.times_given_back()
print(json.dumps({"kept": kept, "threads": threads, "line": line, "times": times, "asked": asked}))
"""


@pytest.mark.skipif(allocator.glibc() is None, reason="glibc 2.33 or later only: this C library is not one")
@pytest.mark.parametrize("refused", ["M_TRIM_THRESHOLD", "M_MMAP_MAX"])
def test_a_refused_mallopt_value_leaves_nothing_kept_without_a_bound(refused):
    result = run_child(ONE_REFUSED, refused)
    if refused == "M_TRIM_THRESHOLD":
        assert result["kept"] is True and result["times"] == 0, result
        assert "malloc-bound" in result["threads"], result
        assert "mmap max 0; glibc's own trim threshold; all given back past 2 GiB kept" in result["line"], result
    else:
        assert result["kept"] is False and result["times"] is None, result
        assert result["asked"] == [allocator.M_MMAP_MAX], result  # the heap's top left as glibc trims it
        assert "malloc-bound" not in result["threads"] and result["line"] == "malloc as the C library sets it"


WALKS = """
import json
from rlhf_pipeline import allocator
real, walks = allocator.glibc(), []

class Counted:
    def __getattr__(self, name):
        return getattr(real, name)

    def mallinfo2(self):
        walks.append(1)
        return real.mallinfo2()

libc = Counted()
anonymous = allocator.resident_anonymous_bytes()
reads, read = [], allocator._status_kib
allocator._status_kib = lambda field: reads.append(field) or read(field)
under = allocator.give_back_beyond(libc, anonymous + (64 << 20)), len(walks), len(reads)
over = allocator.give_back_beyond(libc, 0), len(walks), len(reads)
# the thread's check: RssAnon read once and handed on; once more after a give-back, for the peak
quiet = allocator.bound_check(libc, 1 << 40, 0), len(walks), len(reads)
trimmed = allocator.bound_check(libc, 0, 0), len(walks), len(reads)
print(json.dumps({"under": under, "over": over, "quiet": quiet, "trimmed": trimmed}))
"""


@pytest.mark.skipif(allocator.glibc() is None, reason="glibc 2.33 or later only: this C library is not one")
def test_a_check_within_the_bound_skips_mallinfo2_s_walk():
    """Kept bytes never exceed RssAnon: while RssAnon is within the bound, a check reads /proc alone."""
    result = run_child(WALKS, malloc=allocator.SYSTEM)
    assert result["under"] == [False, 0, 1], result  # no walk; /proc read once
    assert result["over"][1:] == [1, 2], result  # over the bound in RssAnon: walked once, /proc read once more
    (gave_back, peak), walked, read = result["quiet"]
    assert (gave_back, walked, read) == (False, 1, 3) and peak > 0, result  # within: one read, no walk
    (gave_back, peak), walked, read = result["trimmed"]
    assert (gave_back, walked, read) == (True, 2, 5) and peak > 0, result  # a walk, the read, the read after


def test_the_user_s_own_malloc_settings_win():
    assert allocator.keep_freed_memory({"RLHF_MALLOC": "system"}) is False
    assert allocator.keep_freed_memory({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}) is False


def test_an_unknown_rlhf_malloc_value_is_refused_naming_the_variable():
    with pytest.raises(SettingsError, match=r"RLHF_MALLOC='jemalloc' is not one of 'keep' .* or 'system'"):
        allocator.keep_freed_memory({"RLHF_MALLOC": "jemalloc"})


class SeedOnly(StageParams):
    pass


def test_a_stage_under_an_unknown_rlhf_malloc_value_exits_2_before_its_body(tmp_path, monkeypatch, capsys):
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"probe": {"cmd": "true", "params": ["seed"]}}}))
    (tmp_path / "params.yaml").write_text("seed: 5\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RLHF_MALLOC", "tcmalloc")
    ran = []
    with pytest.raises(SystemExit) as exit_:
        run_stage("probe", lambda params: ran.append(params.seed), SeedOnly, argv=[])
    assert exit_.value.code == 2 and ran == []
    assert "stage probe: error: RLHF_MALLOC='tcmalloc' is not one of" in capsys.readouterr().err


def test_the_peak_memory_read_is_this_process_s_own_not_its_parent_s():
    """Linux's ru_maxrss starts a child at its parent's high-water mark (kept across fork and exec): the
    stages' "peak RSS" lines and the hostile-folder memory check read a pytest worker's 1 GB that way."""
    held = bytearray(600 << 20)  # the parent touches 600 MB (bytearray zero-fills it)
    code = "from rlhf_pipeline.allocator import peak_rss_mb; import json; print(json.dumps(peak_rss_mb()))"
    child = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 5 < child < 200, child  # the interpreter and one small module, not the parent's 600 MB
    assert allocator.peak_rss_mb() >= 600 and len(held) == 600 << 20


def test_a_stage_s_last_line_gives_its_peak_and_the_times_freed_memory_was_given_back(tmp_path, monkeypatch, capsys):
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"probe": {"cmd": "true", "params": ["seed"]}}}))
    (tmp_path / "params.yaml").write_text("seed: 5\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RLHF_MALLOC", "keep")
    run_stage("probe", lambda params: None, SeedOnly, argv=[])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    kept = allocator.glibc() is not None and "glibc.malloc." not in os.environ.get("GLIBC_TUNABLES", "")
    tail = r", freed memory past the bound given back \d+ times" if kept else ""
    assert re.fullmatch(rf"stage probe: done in \d+ s, peak RSS \d+ MB{tail}", line), line
