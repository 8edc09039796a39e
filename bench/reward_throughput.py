"""Reward-model training throughput: this project vs TRL 1.12 ``RewardTrainer``, side by side.

Both train the same weights (SmolLM2-135M-Instruct, or ``--tiny``) on the same synthetic pairwise
data (a ``--prompt-tokens`` prompt with ``--response-tokens`` chosen/rejected continuations,
fixed-seed random token ids), the same number of pairs per optimizer step, full fine-tune, fp32,
CPU, for 1 warmup step + ``--steps`` timed steps each:

- ours: :func:`rlhf_pipeline.reward.training.train_reward_model` (N=2 softmax loss == Bradley-Terry) via
  ``RewardModel.score_best_of_n``, which packs each prompt and its two responses into one
  sequence with a block attention mask, so the prompt is computed once for both;
- TRL: ``RewardTrainer`` on ``AutoModelForSequenceClassification(num_labels=1)`` from the same
  directory, with pre-tokenised ``chosen_ids``/``rejected_ids`` (prompt + response each), no eval,
  no logging, no saving, no gradient checkpointing, dataloader workers 0.

Usage::

    .venv/bin/python bench/reward_throughput.py [--model smollm2|smollm2-random|tiny] [--tiny] [--steps 6]
        [--profile [torch|ops]] [--order sequential|interleaved|mirrored] [--first ours|trl]
        [--cpu-numerics portable|compatible|native] [--markdown] [--output FILE]

``--profile`` adds one more step per side under torch's profiler and a table of where its time goes; ``--profile ops``
times that step's aten ops one by one instead (``common.OpTimeProfile``), without the profiler's own cost.
Each side runs in a process of its own, as a user runs one trainer. ``--order mirrored`` (the default) runs all of
ours, then all of TRL's, then TRL's again and ours again: four processes, each alone, so that a drift in the
machine's speed linear in time falls on both sides alike without their steps sharing the cache; the timed steps
are both runs' together. ``--order sequential`` runs each side once (half the time, but a drift over its minutes
falls on one side more than the other); ``--order interleaved`` loads both and runs their steps in turn, one each
(``bench/results/benchmarks.md`` says why it is not the default). ``--first trl`` starts with TRL's side.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import (
    MODEL_NAMES,
    PROFILE_HEADERS,
    OpTimeProfile,
    StepGate,
    StepProfile,
    benchmark_parser,
    emit,
    environment_lines,
    median_usage,
    prepare,
    random_token_ids,
    render_report,
    render_table,
    run_in_turns,
    steal_note,
    trl_cpu_arguments,
)  # noqa: E402

PROFILE_KINDS = {"torch": StepProfile, "ops": OpTimeProfile}  # --profile's choices


def make_data(tokenizer, num_pairs: int, prompt_tokens: int, response_tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts = random_token_ids(tokenizer, (num_pairs, prompt_tokens), g)
    chosen = random_token_ids(tokenizer, (num_pairs, response_tokens), g)
    rejected = random_token_ids(tokenizer, (num_pairs, response_tokens), g)
    return prompts, chosen, rejected


# --------------------------------------------------------------------------------------------
# Each side runs in a process of its own (common.run_in_turns): these load it there and train it, one step a turn.
def train_ours(gate: StepGate, data, args) -> None:
    """The project's reward training (``train_reward_model``), one step a turn."""
    from rlhf_pipeline.params.reward import RewardTrainParams
    from rlhf_pipeline.reward.adoption import reward_model_on_base
    from rlhf_pipeline.reward.training import Labels, train_reward_model

    model_dir, tokenizer = prepare(args)
    prompts, chosen, rejected = data
    model = reward_model_on_base(model_dir, tokenizer.pad_token_id, generator=torch.Generator().manual_seed(args.seed))
    samples = torch.stack([chosen, rejected], dim=1)  # (B, 2, R): index 0 is the preferred one
    best = torch.zeros(len(prompts), dtype=torch.long)
    cfg = RewardTrainParams(lr=args.lr, batch_size=args.batch_pairs, microbatch_size=args.batch_pairs)
    gate.begin()
    train_reward_model(
        model,
        Labels(prompts, samples, best),
        cfg,
        torch.Generator().manual_seed(args.seed),
        log=lambda record: gate.step_ended(),
    )


def train_trl(gate: StepGate, data, args) -> str:
    """TRL's RewardTrainer, one step a turn; returns its optimizer's name. Its set-up inside ``train()``
    (optimizer, data loader) is not timed: the clock starts again at ``on_train_begin``."""
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, TrainerCallback
    from trl import RewardConfig, RewardTrainer

    model_dir, tokenizer = prepare(args)
    prompts, chosen, rejected = data
    dataset = Dataset.from_dict(
        {
            "chosen_ids": torch.cat([prompts, chosen], 1).tolist(),
            "rejected_ids": torch.cat([prompts, rejected], 1).tolist(),
        }
    )
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id

    class StepTimer(TrainerCallback):
        def on_train_begin(self, *a, **k):
            gate.restart_clock()

        def on_step_end(self, *a, **k):
            gate.step_ended()

    with tempfile.TemporaryDirectory() as out_dir:
        config = RewardConfig(
            output_dir=out_dir,
            per_device_train_batch_size=args.batch_pairs,
            gradient_accumulation_steps=1,
            max_steps=gate.steps,
            learning_rate=args.lr,
            adam_epsilon=1e-5,
            weight_decay=0.0,
            lr_scheduler_type="linear",
            warmup_steps=0,
            max_length=None,
            **trl_cpu_arguments(args.seed),
        )
        trainer = RewardTrainer(
            model=model, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[StepTimer()]
        )
        gate.begin()
        trainer.train()
    optimizer = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    return f"{type(optimizer).__name__} ({config.optim})"


def order_note(order: str, passes: list[dict[str, list[float]]], steps: int, first: str) -> str:
    """How the two sides' steps were taken (``passes``: each pass's seconds a side, warm-up step first). With
    ``interleaved``, the ratio of each step pair run back to back (TRL's k-th timed step over ours); with
    ``mirrored``, each pass's ratio of the medians: the measures a drift over minutes cannot move, or moves
    in opposite ways."""
    names = {"ours": "ours", "trl": "TRL's"}
    one, other = (names["trl"], names["ours"]) if first == "trl" else (names["ours"], names["trl"])
    if order == "sequential":
        return (
            f"order: sequential, all of {one} and then all of {other}; each side in a process of its own (spawned), "
            "one after the other, each alone in memory."
        )
    if order == "mirrored":
        text = (
            f"order: mirrored, all of {one}, then all of {other}, then all of {other} again and all of {one} again; "
            "each run a process of its own (spawned), alone in memory, so that a drift linear in time falls on "
            "both sides alike; the timed steps are both runs' together"
        )
        if len(passes[0]) < 2:
            return text + "."
        ratios = [
            statistics.median(run["trl"][1 : steps + 1]) / statistics.median(run["ours"][1 : steps + 1])
            for run in passes
        ]
        return text + "; TRL's median step over ours, each pass: " + ", ".join(f"{r:.2f}x" for r in ratios) + "."
    seconds = passes[0]
    text = (
        f"order: interleaved, one step of {one} and then one of {other}, in turn; each side in a process of its own "
        "(spawned), both loaded before the first step"
    )
    if len(seconds) < 2:
        return text + "."
    pairs = sorted(b / a for a, b in zip(seconds["ours"][1 : steps + 1], seconds["trl"][1 : steps + 1]))
    return text + (
        f"; TRL's step over ours, pair by pair: median {statistics.median(pairs):.2f}x, "
        f"from {pairs[0]:.2f}x to {pairs[-1]:.2f}x over {len(pairs)} pairs."
    )


# --------------------------------------------------------------------------------------------
def argument_parser():
    """The bench's options (the reward side's settings, which probes reuse through ``parse_args([])``)."""
    parser = benchmark_parser(__doc__)
    parser.add_argument(
        "--steps",
        type=int,
        default=16,
        help="timed optimizer steps per implementation, after 1 warm-up step reported apart (16: the mean is the "
        "steady state; with 6-10 the first timed steps' leftover allocation cost moves it by up to 10 %%)",
    )
    parser.add_argument("--batch-pairs", type=int, default=8, help="preference pairs per optimizer step")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--response-tokens", type=int, default=24)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--only", choices=["ours", "trl"], help="run one side only (debugging)")
    parser.add_argument(
        "--order",
        choices=["sequential", "interleaved", "mirrored"],
        default="mirrored",
        help="mirrored (the default): sequential, then sequential backwards (ours, TRL, TRL, ours), each run alone "
        "as a user runs one trainer, so that a drift linear in time falls on both alike (on the AVX2-only AMD EPYC "
        "sequential runs read 1.42-1.53x over one afternoon, and a mirrored run's two passes 1.51x and 1.66x); "
        "sequential: each side's process runs all its steps once, alone (half the time); "
        "interleaved: both load, then they take turns a step at a time, so that the machine's drift over minutes "
        "falls on both alike (on a 2-core Intel Xeon it read 1.50-1.57x where sequential read 1.39-1.49x, TRL's "
        "steps being the slower interleaved: the last-level cache, bench/results/probe_llc_neighbour.md)",
    )
    parser.add_argument(
        "--profile",
        nargs="?",
        const="torch",
        choices=["torch", "ops"],
        help="run one more step per side under torch's profiler (or, with 'ops', with each aten op timed by a clock "
        "of its own, common.OpTimeProfile) and add a table of where its time goes (matrix products, attention, "
        "optimizer step, other), the matrix products' GFLOP/s and the largest other ops",
    )
    parser.add_argument(
        "--first",
        choices=["ours", "trl"],
        default="ours",
        help="the side whose step runs first in each turn (interleaved) or which runs first (sequential): a check "
        "that the position does not move the ratio",
    )
    return parser


def main(argv=None) -> None:
    args = argument_parser().parse_args(argv)

    model_dir, tokenizer = prepare(args)
    steps = args.steps + 1 + bool(args.profile)  # the warm-up step, the timed ones, the profiled one
    data = make_data(tokenizer, args.batch_pairs * steps, args.prompt_tokens, args.response_tokens, args.seed)

    first = ("trl", "ours") if args.first == "trl" else ("ours", "trl")
    sides = [name for name in first if not args.only or name == args.only]
    print(f"[reward_throughput] loading {', '.join(sides)}, then steps {args.order}", file=sys.stderr, flush=True)
    trainers = {"ours": train_ours, "trl": train_trl}
    runs = []  # one pass of run_in_turns, or with mirrored two, the second backwards
    for pass_sides in [sides, sides[::-1]] if args.order == "mirrored" else [sides]:
        # the report's profile is the first pass's: a later pass runs without the profiled step, and with its
        # data cut to match (our trainer runs as many steps as its data holds)
        pass_steps = steps if not runs else args.steps + 1
        pass_data = tuple(tensor[: args.batch_pairs * pass_steps] for tensor in data)
        runs.append(
            run_in_turns(
                {name: (trainers[name], (pass_data, args)) for name in pass_sides},
                steps=pass_steps,
                interleaved=args.order == "interleaved",
                profile_step=steps if args.profile and not runs else None,
                profile_kind=PROFILE_KINDS[args.profile or "torch"],
            )[0]
        )
        for name in pass_sides:
            print(
                f"[reward_throughput] {name} step times: {[round(t, 3) for t in runs[-1][name].seconds]}",
                file=sys.stderr,
                flush=True,
            )
    measured = runs[0]  # the warm-up step, the profile and TRL's optimizer are the first pass's
    results = {name: measured[name].seconds for name in ("ours", "trl") if name in measured}  # ours' row first
    profiles = {name: measured[name].profile for name in results if measured[name].profile is not None}
    # the timed steps (and their usage): every pass's, after its warm-up step
    timed = {name: [t for run in runs for t in run[name].seconds[1 : args.steps + 1]] for name in results}
    timed_usage = {name: [u for run in runs for u in run[name].usage[1 : args.steps + 1]] for name in results}
    trl_optimizer = measured["trl"].extra if "trl" in measured else "n/a"

    labels = {
        "ours": "rlhf_pipeline train_reward_model (score_best_of_n, N=2, prompt shared in one packed sequence)",
        "trl": "TRL 1.12 RewardTrainer (AutoModelForSequenceClassification)",
    }
    sec = {name: sum(t) / len(t) for name, t in timed.items()}
    # the median shows the steady state: on CPU the first timed step still pays one-off allocations
    med = {name: statistics.median(t) for name, t in timed.items()}
    rows = []
    for name in results:
        ratio = f"{sec['trl'] / sec[name]:.2f}x" if "trl" in sec else "n/a"
        median_ratio = f"{med['trl'] / med[name]:.2f}x" if "trl" in med else "n/a"
        rows.append(
            [
                labels[name],
                f"{args.batch_pairs / sec[name]:.2f}",
                f"{sec[name]:.3f}",
                f"{med[name]:.3f}",
                f"{results[name][0]:.3f}",
                ratio,
                median_ratio,
            ]
        )
    table = render_table(
        [
            "implementation",
            "pairs/s",
            "s/step (mean)",
            "s/step (median)",
            "warmup step s",
            "speed vs TRL (mean)",
            "speed vs TRL (median)",
        ],
        rows,
        args.markdown,
    )
    model_name = MODEL_NAMES[args.model]
    notes = [
        f"workload: {args.batch_pairs} pairs/step, prompt {args.prompt_tokens} tokens + chosen/rejected "
        f"{args.response_tokens} tokens each "
        f"(fixed-seed random token ids, no padding), full fine-tune, lr {args.lr}, 1 warmup step + {args.steps} "
        + ("timed steps per side" if len(runs) == 1 else f"timed steps per side and run, {len(runs)} runs a side")
        + " (mean of the timed steps).",
        f"ours: Adam (eps 1e-5), one microbatch per step; per step it runs {args.batch_pairs} packed rows of prompt "
        "+ chosen + rejected "
        f"({args.batch_pairs}x{args.prompt_tokens + 2 * args.response_tokens} tokens, block attention mask).",
        "TRL: pre-tokenised chosen_ids/rejected_ids = prompt + response "
        f"({2 * args.batch_pairs}x{args.prompt_tokens + args.response_tokens} tokens per step), optimizer "
        f"{trl_optimizer}, "
        "no eval/logging/saving/gradient checkpointing, report_to none, use_cpu, dataloader workers 0; a step's time "
        "runs from its turn's start (TRL's first: on_train_begin) to its on_step_end callback.",
        order_note(args.order, [{name: run[name].seconds for name in run} for run in runs], args.steps, args.first),
        "speed vs TRL = TRL seconds/step / implementation seconds/step (>1 means faster than TRL), from the mean "
        "and from the median of the timed steps.",
        "page faults a timed step (median; minor faults, and the system time the process spent, on its threads "
        "together): "
        + "; ".join(
            "{}: {:.0f} faults, {:.2f} s, kept memory given back {} times over the timed steps".format(
                name, *median_usage(timed_usage[name])
            )
            for name in results
        )
        + " (the memory line above says what malloc keeps and when it gives it back).",
        steal_note(timed_usage),
    ]
    if profiles:
        profile_rows = [[labels[name].split(" (")[0], *profiles[name].row()] for name in profiles]
        kind = PROFILE_KINDS[args.profile]
        table += f"\n\nWhere one more step's time goes ({kind.title}):\n\n" + render_table(
            ["implementation", *PROFILE_HEADERS], profile_rows, args.markdown
        )
        notes.append(
            f"profile: one step per side after the timed ones{' of the first pass' if len(runs) > 1 else ''}, "
            f"{kind.method}; matrix products = "
            "aten::mm/addmm/bmm/baddbmm, attention = the scaled-dot-product "
            "kernels and their backward, optimizer step = Adam's fused or foreach kernels and gradient clipping's "
            "norms, other = every other op's self time (RMS norms, activations, masks, copies, zeroing, the "
            "clipping's scaling); the groups' sum is below the step's wall time by the time "
            "outside any op (Python, the trainers' own bookkeeping); matmul GFLOP/s = those ops' FLOPs over their "
            "self time."
        )
        notes += [
            f"largest other ops ({kind.other_labels}), {name}: {profiles[name].other_summary()}" for name in profiles
        ]
        notes.append(
            "the timing's own cost: the profiled step against the timed steps' median, "
            + "; ".join(f"{name} {profile.wall:.2f} s against {med[name]:.2f} s" for name, profile in profiles.items())
            + " (where the two differ, the timing has slowed the ops it timed, and their times above are inflated)"
        )
    emit(
        render_report("Reward-model training throughput", environment_lines(model_name), table, notes, args.markdown),
        args.output,
    )


if __name__ == "__main__":
    main()
