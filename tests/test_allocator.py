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
    assert (
        "no block mapped apart: mmap max 0; trim beyond 2 GiB; all free memory given back when the heap grows"
        in (keep["line"])
    )
    assert system["line"] == "malloc as the C library sets it"


# Freed memory the heap cannot give back by trimming its top: 4 blocks of 48 MiB written, each followed by a
# small block still in use, then the large ones freed. The thread that bounds what is kept runs at a 64 MiB
# bound here (2 GiB in the stages), either on its own or called once by hand.
HOLES = """
import ctypes, json, resource, sys, time
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
    time.sleep(0.2)  # the thread sees the heap at this size
for block in large:
    libc.free(block)
held = allocator.kept_bytes(libc)
plateau = refilled = None
if by_thread:
    time.sleep(0.5)  # the heap has not grown: what it keeps stays
    plateau = [allocator.times_given_back(), allocator.kept_bytes(libc)]
    grow = libc.malloc(256 << 20)  # too large for the holes: the heap grows
    # its first page written, then a pause: the checks see a block in use whose pages are not yet resident
    ctypes.memset(grow, 1, 4096)
    time.sleep(0.3)
    ctypes.memset(grow, 1, 256 << 20)
    time.sleep(0.5)
    after = allocator.kept_bytes(libc)
    # the process fills its holes again and frees them, three times: RssAnon climbs back past what the trim
    # left, with 192 MiB kept, but the heap does not grow, so the holes stay and only the first round faults
    times, faults = allocator.times_given_back(), []
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        large = [libc.malloc(size) for _ in range(4)]
        for block in large:
            ctypes.memset(block, 1, size)
        for block in large:
            libc.free(block)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        time.sleep(0.3)
    refilled = [allocator.times_given_back() - times, faults, allocator.kept_bytes(libc)]
    given = None
else:
    heap = allocator.heap_bytes(libc.mallinfo2())
    given = [
        allocator.give_back_beyond(libc, 1 << 40),
        allocator.give_back_beyond(libc, allocator.KEPT_BOUND, heap),
        allocator.give_back_beyond(libc, allocator.KEPT_BOUND),
    ]
    after = allocator.kept_bytes(libc)
print(json.dumps({"kept": kept, "held": held, "after": after, "given": given,
                  "times": allocator.times_given_back(), "plateau": plateau, "refilled": refilled}))
"""


@pytest.mark.skipif(allocator.glibc() is None, reason="glibc 2.33 or later only: this C library is not one")
@pytest.mark.parametrize("how", ["by hand", "thread"])
def test_freed_memory_past_the_bound_is_given_back_when_the_heap_grows(how):
    """What keeping costs is bounded: freed blocks held in the heap's middle (192 MiB, past a 64 MiB
    bound) are given back by malloc_trim, by one check or by the stage's thread, once the heap grows while
    they are held; under the bound, or while the heap does not grow, they stay for reuse."""
    result = run_child(HOLES, how)
    assert result["kept"] is True
    assert result["held"] > 180 << 20, result  # the four freed blocks stayed resident
    assert result["after"] < 64 << 20, result  # given back
    if how == "by hand":
        # a 1 TiB bound, then a heap no larger than at the last look: nothing to do; then no look before: trimmed
        heap = result["given"][1][1]
        assert result["given"] == [[False, 0], [False, heap], [True, heap]] and heap > 190 << 20, result
        assert result["times"] == 0, result
    else:
        times_at_plateau, kept_at_plateau = result["plateau"]
        assert times_at_plateau == 0 and kept_at_plateau > 180 << 20, result  # kept while the heap did not grow
        assert result["times"] >= 1, result  # given back once the heap grew, though the new block was not written


@pytest.mark.skipif(allocator.glibc() is None, reason="glibc 2.33 or later only: this C library is not one")
def test_holes_filled_again_after_a_give_back_stay_kept():
    """After a give-back, the process takes its holes again and frees them: RssAnon passes what the trim
    left, with more than the bound free, but the heap has not grown, so nothing goes back and only the
    first round faults its pages in (the earlier rule, past the highest RssAnon since a trim, gave them
    back every round: PPO with a separate value model, 4.1 M faults an update)."""
    result = run_child(HOLES, "thread")
    given, faults, kept_after = result["refilled"]
    pages = 4 * (48 << 20) // 4096
    assert given == 0, result
    assert faults[0] > pages // 2, result  # the trim had given the holes' pages back
    assert max(faults[1:]) < pages // 20, result  # then they stayed
    assert kept_after > 180 << 20, result


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
        assert "mmap max 0; glibc's own trim threshold; all free memory given back when" in result["line"], result
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
allocator._status_kib = lambda *fields: reads.append(fields) or read(*fields)
under = allocator.give_back_beyond(libc, anonymous + (64 << 20))[0], len(walks), len(reads)
over = allocator.give_back_beyond(libc, 0)[0], len(walks), len(reads)
# the thread's check: RssAnon read once; a walk only when it grew since the last check
first = allocator.bound_check(libc, 0, 1 << 50, 0)  # grew from nothing: walks; no heap is over 1 PiB: no trim
grown = first[:2], len(walks), len(reads)
same = allocator.bound_check(libc, 0, 0, first[2] + (1 << 30)), len(walks), len(reads)  # no growth: no walk
trimmed = allocator.bound_check(libc, 0, 0, 0), len(walks), len(reads)
print(json.dumps({"under": under, "over": over, "grown": grown, "same": same, "trimmed": trimmed}))
"""


@pytest.mark.skipif(allocator.glibc() is None, reason="glibc 2.33 or later only: this C library is not one")
def test_a_check_walks_mallinfo2_only_past_the_bound_and_when_rss_grew():
    """Kept bytes never exceed RssAnon, and neither they nor a grown heap's written pages appear without
    RssAnon growing: a check within the bound, or one that finds RssAnon no higher than the last check did,
    reads /proc alone (a walk over a fragmented heap's free chunks takes milliseconds)."""
    result = run_child(WALKS, malloc=allocator.SYSTEM)
    assert result["under"] == [False, 0, 1], result  # no walk; /proc read once
    assert result["over"][1:] == [1, 2], result  # over the bound in RssAnon: walked once, /proc read once more
    (gave_back, heap), walked, read = result["grown"]
    assert (gave_back, walked, read) == (False, 2, 3) and 0 < heap < 1 << 50, result  # walked: the heap it read
    (gave_back, _, _), walked, read = result["same"]
    assert (gave_back, walked, read) == (False, 2, 4), result  # RssAnon no higher: one read, no walk
    (gave_back, heap, anonymous), walked, read = result["trimmed"]
    assert (gave_back, walked, read) == (True, 3, 6) and heap > 0 and anonymous > 0, result  # read, walk, read


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
    gpu = r"(, peak GPU memory \d+ MB)?"  # where the suite runs on a GPU host that an earlier test used
    assert re.fullmatch(rf"stage probe: done in \d+ s, peak RSS \d+ MB{gpu}{tail}", line), line


def test_a_stage_that_used_a_gpu_gives_its_peak_gpu_memory(tmp_path, monkeypatch, capsys):
    """The GPU's high-water mark goes on the same line, read from torch's caching allocator (the
    nvidia-smi sampling docs/gpu.md needed on 2026-11-30 to get it per stage); none where no GPU was used."""
    import torch

    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"probe": {"cmd": "true", "params": ["seed"]}}}))
    (tmp_path / "params.yaml").write_text("seed: 5\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *args: 9 << 30)
    run_stage("probe", lambda params: None, SeedOnly, argv=[])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.match(r"stage probe: done in \d+ s, peak RSS \d+ MB, peak GPU memory 9216 MB(,|$)", line), line
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    run_stage("probe", lambda params: None, SeedOnly, argv=[])
    assert "GPU" not in capsys.readouterr().out.strip().splitlines()[-1]
