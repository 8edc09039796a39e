"""The KV cache of a sampling call on a CPU: transformers' growing cache against one that writes into room it reserved.

transformers' ``DynamicLayer`` concatenates each step's keys and values onto the cache, so a step copies the whole
cache of every layer (``aten::cat`` in a sampling call's profile). The candidate here, :class:`RoomyLayer`, allocates
room for :data:`RESERVE` more tokens whenever it grows and writes each step's keys and values into it; attention then
reads views of the larger buffer. This probe times one whole preferences call (64 queries x 4 samples, 24 query
tokens, 16 sampled, on ``models/base``) with each cache, interleaved, checks that both draw the same tokens with the
same logprobs, bit for bit, and with ``--profile`` gives each call's time by aten op.

Usage: ``.venv/bin/python bench/probe_kv_cache.py [--calls 3] [--profile] [--markdown] [--output FILE]``, alone on
the machine, under the stages' numerics (``portable``) and malloc setting (:func:`allocator.keep_freed_memory`).
Findings: ``bench/results/zen3_2026-12-03/README.md`` at commit def2191 (``git show def2191:PATH``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import OpClock, emit_table, environment_lines, render_table, run_as_a_stage  # noqa: E402
from probe_draw import BASE, QUERIES, RESPONSE, SAMPLES, base_model_and_queries, milliseconds  # noqa: E402
from probe_draw import preferences_call as call_with_draw  # noqa: E402
from transformers.cache_utils import DynamicCache, DynamicLayer  # noqa: E402

from rlhf_pipeline import sampling  # noqa: E402
from rlhf_pipeline.decoding import sample_from_logits  # noqa: E402

RESERVE = RESPONSE  # tokens of room a layer makes each time it outgrows its buffer


class RoomyLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are views of buffers with room for :data:`RESERVE` more tokens."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, new = self.get_seq_length(), key_states.shape[-2]
        room = getattr(self, "room", None)
        if room is None or room[0].shape[0] != key_states.shape[0] or room[0].shape[-2] < length + new:
            shape = (*key_states.shape[:-2], length + new + RESERVE, key_states.shape[-1])
            room = self.room = (key_states.new_empty(shape), value_states.new_empty(shape))
            if length:
                room[0][..., :length, :].copy_(self.keys)
                room[1][..., :length, :].copy_(self.values)
        room[0][..., length : length + new, :].copy_(key_states)
        room[1][..., length : length + new, :].copy_(value_states)
        self.keys, self.values = room[0][..., : length + new, :], room[1][..., : length + new, :]
        return self.keys, self.values

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)  # new, contiguous tensors: the next update makes room again
        self.room = None


class RoomyCache(DynamicCache):
    """transformers' cache for ``config``, its full-attention layers :class:`RoomyLayer` (sliding ones as they are)."""

    made = 0  # how many the sampler made: the probe checks that its patch took

    def __init__(self, config=None, **kwargs):
        super().__init__(config=config, **kwargs)
        RoomyCache.made += 1
        self.layers = [RoomyLayer() if type(layer) is DynamicLayer else layer for layer in self.layers]


@contextmanager
def sampling_cache(cache_class):
    """The sampler's ``from transformers import DynamicCache`` gets ``cache_class``. The import reads the module in
    ``sys.modules``, which loading a model replaces with a new lazy module, so that is the one patched, at each call."""
    module = sys.modules["transformers"]
    shipped = module.DynamicCache  # makes the lazy module load it into its namespace
    vars(module)["DynamicCache"] = cache_class
    try:
        yield
    finally:
        vars(module)["DynamicCache"] = shipped


def preferences_call(model, queries: torch.Tensor, pad: int, cache_class) -> sampling.SampleOutput:
    """One of preferences' sampling calls (:func:`probe_draw.preferences_call`, shipped draw) over ``cache_class``."""
    with sampling_cache(cache_class):
        return call_with_draw(model, queries, pad, sample_from_logits)


def profile_rows(model, queries, pad, caches) -> list[list[str]]:
    """Each cache's call, aten op by aten op: the ops that are among either call's eight longest."""
    clocks = {}
    for side, cache_class in caches.items():
        clocks[side] = OpClock()
        with clocks[side]:
            preferences_call(model, queries, pad, cache_class)
    names = list(dict.fromkeys(name for clock in clocks.values() for name, _ in clock.seconds.most_common(8)))
    rows = [[name, *(f"{clocks[side].seconds[name]:.2f}" for side in caches)] for name in names]
    return rows + [["all ops", *(f"{sum(clocks[side].seconds.values()):.2f}" for side in caches)]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3, help="timed whole sampling calls a side")
    parser.add_argument("--profile", action="store_true", help="also print each call's time by aten op")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--output")
    args = parser.parse_args()
    run_as_a_stage()
    if not Path(BASE, "config.json").exists():
        raise SystemExit(f"bench/probe_kv_cache.py needs {BASE}: run `dvc repro base_model` first")
    model, pad, queries = base_model_and_queries()
    caches = {"transformers' DynamicCache": DynamicCache, "room reserved": RoomyCache}
    outputs = {side: preferences_call(model, queries, pad, cache) for side, cache in caches.items()}  # also warms up
    if RoomyCache.made == 0:
        raise SystemExit("bench/probe_kv_cache.py: the sampler did not take the candidate cache")
    first, second = outputs.values()
    same = torch.equal(first.responses, second.responses) and torch.equal(first.logprobs, second.logprobs)
    times = {side: [] for side in caches}
    for _ in range(args.calls):  # interleaved, so a drift in the machine's rate falls on both
        for side, cache in caches.items():
            times[side].append(milliseconds(lambda c=cache: preferences_call(model, queries, pad, c)) / 1000)
    old, new = (statistics.median(times[side]) for side in caches)
    if args.profile:
        print(render_table(["aten op", *caches], profile_rows(model, queries, pad, caches), markdown=True) + "\n")
    label = f"{QUERIES} x {SAMPLES} rows, {RESPONSE} tokens: a whole preferences call on {BASE}, s"
    emit_table(
        "The KV cache of a sampling call on a CPU",
        environment_lines(f"{BASE} (SmolLM2-135M-Instruct)"),
        ["workload", *caches, "speed-up", "same tokens and logprobs"],
        [[label, f"{old:.2f}", f"{new:.2f}", f"{old / new:.2f}x", str(same)]],
        [f"median of {args.calls} interleaved calls a side after one each; room: {RESERVE} tokens a growth"],
        args,
    )


if __name__ == "__main__":
    main()
