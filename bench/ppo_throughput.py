"""PPO throughput: this project's ``PPOTrainer`` vs TRL 1.12 ``PPOTrainer`` (trl.experimental.ppo).

Same weights (SmolLM2-135M-Instruct, or ``--tiny``), same fixed-seed random queries of
``--query-tokens`` tokens, ``--response-tokens`` sampled tokens at temperature 0.7 with no
stop token, ``--batch`` episodes per update, one minibatch, 4 PPO epochs, full fine-tune, fp32,
CPU. Each side runs 1 warmup update + ``--updates`` timed updates (the table: their medians). The
warm-up update's matrix-product FLOPs are counted (torch's ``FlopCounterMode``: forward and backward),
so the table also says how many FLOPs each side spends per update, at what rate, and the ratio the
two would have at equal rates: what a faster kernel cannot change.

- ours (value_model 'shared', the reference): policy LM + zero-init scalar value head on the
  policy backbone; reference model; reward model. Truncation token '.' after 16 tokens (the
  task's post-processing, applied before scoring).
- ours (value_model 'separate'): a separate value model (backbone + head initialised like the
  reward model), i.e. TRL's structure: four transformers, two of them trained.
- TRL: policy, ref_model, reward_model and value_model
  (``AutoModelForSequenceClassification(num_labels=1)``) all loaded from the same directory;
  ``per_device_train_batch_size=--microbatch``, ``gradient_accumulation_steps=batch/microbatch``,
  ``num_mini_batches=1``, ``local_rollout_forward_batch_size=batch``, ``stop_token=None``,
  ``missing_eos_penalty=None``.

Time breakdown: ours from the per-update timings the trainer keeps (time/generation,
time/reference (+ value forward when separate), time/scoring, time/training); TRL by wrapping
``batch_generation``, ``forward`` (no-grad = reference) and ``get_reward`` (value / reward model)
in the ppo_trainer module namespace, and ``accelerator.backward`` / ``optimizer.step``.

Each side runs in a process of its own (spawned), as a user runs one trainer, so no side inherits another's
malloc heap: before 2026-11-30 all sides ran in one process, and TRL's, running last, refaulted pages the others
had left (5.4 M an update once). ``--order sequential`` (the default) runs one side's process at a time;
``--order interleaved`` loads every side, then passes the turn after every update.

Usage::

    .venv/bin/python bench/ppo_throughput.py [--model smollm2|smollm2-random|tiny] [--tiny] [--updates 2]
        [--order sequential|interleaved] [--markdown] [--output FILE]
"""

from __future__ import annotations

import gc
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import (
    MODEL_NAMES,
    MatmulFlops,
    StepGate,
    benchmark_parser,
    emit,
    environment_lines,
    median_usage,
    prepare,
    random_token_ids,
    render_report,
    render_table,
    run_in_turns,
    seed_everything,
    steal_note,
    trl_cpu_arguments,
)  # noqa: E402

PHASES = ["generation", "ref_value", "reward", "train", "other"]


# --------------------------------------------------------------------------------------------
# ours
# --------------------------------------------------------------------------------------------
def run_ours(
    gate: StepGate,
    model_dir: Path,
    tokenizer,
    queries: torch.Tensor,
    args,
    value_model: str,
    profiler=None,
    lora_rank: int = 0,
) -> list[dict]:
    """Per-update phase times (seconds) of the project's PPOTrainer, warmup update included; the first
    record also holds the peak memory (``peak_bytes``: the GPU's allocated peak on CUDA, the process's peak
    resident memory on the CPU). ``lora_rank`` > 0: a LoRA
    adapter of that rank on every linear layer (``ppo.lora``), the reference being the adapter switched off.

    ``profiler`` (a not-yet-started ``torch.profiler.profile``) is started after the warmup update
    and stopped at the end, so it sees the timed updates only. The first record also holds the warm-up
    update's matrix-product FLOPs (``flops``).
    """
    from rlhf_pipeline.allocator import peak_rss_mb
    from rlhf_pipeline.devices import resolve_device
    from rlhf_pipeline.params.schema import Params
    from rlhf_pipeline.ppo.parts import trainer_parts
    from rlhf_pipeline.ppo.trainer import PPOTrainer
    from rlhf_pipeline.reward.adoption import reward_model_on_base

    params = Params.model_validate(
        {
            "seed": args.seed,
            "compute": {"device": args.device},
            "task": {
                "response_length": args.response_tokens,
                "temperature": 0.7,
                "truncate_token": ".",
                "truncate_after": 16,
                "stop_at_eos": False,
            },
            "ppo": {
                "total_episodes": args.batch * (args.updates + 1),
                "batch_size": args.batch,
                "nminibatches": 1,
                "microbatch_size": args.microbatch,
                "ppo_epochs": 4,
                "lr": args.lr,
                "freeze_layers": args.freeze_layers,
                "value_model": value_model,
                "checkpoint_every": 10**6,
                "recompute_logits": args.recompute_logits,
                **({"lora": {"rank": lora_rank}} if lora_rank else {}),
            },
        }
    )
    plan = resolve_device(params.compute.device, params.compute.cuda_precision)
    on_gpu = plan.device.type == "cuda"
    if on_gpu:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    seed_everything(args.seed)
    # random heads on the base model: what the bench times does not depend on what the reward model learned
    value_init = None
    if value_model == "separate":
        value_init = reward_model_on_base(
            model_dir, tokenizer.pad_token_id, generator=torch.Generator().manual_seed(args.seed + 1)
        )
    reward_model = reward_model_on_base(
        model_dir, tokenizer.pad_token_id, generator=torch.Generator().manual_seed(args.seed)
    ).to(plan.device)

    flops = MatmulFlops()

    def log(record: dict) -> None:
        if record["update"] == 1:
            flops.stop()
            if profiler is not None:
                profiler.start()
        gate.step_ended()  # the trainer's update clock stopped before this call and starts after it

    # the stage's factory: the same policy, reference (none with LoRA) and checks as train_policy
    parts = trainer_parts(
        model_dir,
        params.ppo,
        params.task,
        args.seed,
        plan.device,
        queries,
        tokenizer,
        reward_model=reward_model,
        value_from=value_init,
        log=log,
        autocast=plan.autocast if plan.autocast_dtype else None,
        cuda_sampler=plan.sampler,
    )
    trainer = PPOTrainer(parts)
    gate.begin()
    flops.start()
    try:
        trainer.train(progress=False)
    finally:
        flops.stop()
    if profiler is not None:
        profiler.stop()
    out = []
    for times in trainer.timings:  # seconds per phase, kept apart from the statistics the run records
        phases = {
            "generation": times.generation,
            "ref_value": times.reference,
            "reward": times.scoring,
            "train": times.training,
        }
        phases["other"] = times.update - sum(phases.values())
        out.append({"update": times.update, **phases})
    out[0]["peak_bytes"] = torch.cuda.max_memory_allocated() if on_gpu else peak_rss_mb() * 2**20
    out[0]["flops"] = flops.total
    del trainer, parts, reward_model, value_init
    gc.collect()
    return out


# --------------------------------------------------------------------------------------------
# TRL
# --------------------------------------------------------------------------------------------
class PhaseClock:
    def __init__(self):
        self.acc: dict[str, float] = defaultdict(float)

    def wrap(self, fn, phase_of):
        def timed(*a, **k):
            phase = phase_of(*a, **k)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.acc[phase] += time.perf_counter() - t0

        return timed

    def take(self) -> dict[str, float]:
        snapshot, self.acc = dict(self.acc), defaultdict(float)
        return snapshot


def run_trl(gate: StepGate, model_dir: Path, tokenizer, queries: torch.Tensor, args, profiler=None) -> list[dict]:
    """Per-update phase times (seconds) of TRL's PPOTrainer, warmup update included; the first record also
    holds the warm-up update's matrix-product FLOPs (``flops``)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as trl_ppo

    seed_everything(args.seed)

    def load_lm():
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)

    def load_cls():
        return AutoModelForSequenceClassification.from_pretrained(str(model_dir), num_labels=1, dtype=torch.float32)

    policy, ref_model = load_lm(), load_lm()
    reward_model, value_model = load_cls(), load_cls()
    for m in (policy, ref_model, reward_model, value_model):
        m.config.pad_token_id = tokenizer.pad_token_id
    dataset = Dataset.from_dict({"input_ids": queries.tolist()})

    clock = PhaseClock()
    reward_model_id = id(reward_model)  # the wrapper must not keep the model alive past its `del`
    originals = {name: getattr(trl_ppo, name) for name in ("batch_generation", "forward", "get_reward")}
    trl_ppo.batch_generation = clock.wrap(originals["batch_generation"], lambda *a, **k: "generation")
    trl_ppo.forward = clock.wrap(
        originals["forward"], lambda *a, **k: "train" if torch.is_grad_enabled() else "ref_value"
    )
    trl_ppo.get_reward = clock.wrap(
        originals["get_reward"], lambda model, *a, **k: "reward" if id(model) == reward_model_id else "ref_value"
    )

    updates: list[dict] = []
    flops = MatmulFlops()

    class UpdateTimer(TrainerCallback):
        last = None

        def on_train_begin(self, *a, **k):
            gate.restart_clock()
            flops.start()
            self.last = time.perf_counter()

        def on_step_end(self, *a, **k):
            now = time.perf_counter()
            phases = clock.take()
            record = {"update": now - self.last, **{p: phases.get(p, 0.0) for p in PHASES[:-1]}}
            record["other"] = record["update"] - sum(record[p] for p in PHASES[:-1])
            updates.append(record)
            if len(updates) == 1:
                flops.stop()
                if profiler is not None:
                    profiler.start()
            gate.step_ended()  # the wait for the next turn is not in the next update's time
            self.last = time.perf_counter()

    ga = args.batch // args.microbatch
    try:
        with tempfile.TemporaryDirectory() as out:
            config = PPOConfig(
                output_dir=out,
                per_device_train_batch_size=args.microbatch,
                gradient_accumulation_steps=ga,
                num_mini_batches=1,
                local_rollout_forward_batch_size=args.batch,
                num_ppo_epochs=4,
                total_episodes=args.batch * (args.updates + 1),
                response_length=args.response_tokens,
                stop_token=None,
                temperature=0.7,
                missing_eos_penalty=None,
                learning_rate=args.lr,
                adam_epsilon=1e-5,
                kl_coef=0.15,
                whiten_rewards=True,
                num_sample_generations=0,
                **trl_cpu_arguments(args.seed),
            )
            trainer = PPOTrainer(
                args=config,
                processing_class=tokenizer,
                model=policy,
                ref_model=ref_model,
                reward_model=reward_model,
                train_dataset=dataset,
                value_model=value_model,
                callbacks=[UpdateTimer()],
            )
            accelerator, optimizer = trainer.accelerator, trainer.optimizer
            accelerator.backward = clock.wrap(accelerator.backward, lambda *a, **k: "train")
            optimizer.step = clock.wrap(optimizer.step, lambda *a, **k: "train")
            args.trl_optimizer = f"{type(getattr(optimizer, 'optimizer', optimizer)).__name__} ({config.optim})"
            gate.begin()
            trainer.train()
            if profiler is not None:
                profiler.stop()
    finally:
        flops.stop()
        for name, fn in originals.items():
            setattr(trl_ppo, name, fn)
    updates[0]["flops"] = flops.total
    updates[0]["trl_optimizer"] = args.trl_optimizer
    del trainer, policy, ref_model, reward_model, value_model
    gc.collect()
    return updates


# --------------------------------------------------------------------------------------------
# Each side runs in a process of its own (common.run_in_turns): these load it there and train it, one update a turn.
def side_ours(gate: StepGate, queries: torch.Tensor, args, value_model: str, lora_rank: int = 0) -> dict:
    """This project's PPOTrainer in this process: its update records, and with ``--profile`` the op table."""
    model_dir, tokenizer = prepare(args)
    profiler = new_profiler(args)
    records = run_ours(gate, model_dir, tokenizer, queries, args, value_model, profiler, lora_rank)
    return {"records": records, "ops": op_table(profiler, args)}


def side_trl(gate: StepGate, queries: torch.Tensor, args) -> dict:
    """TRL's PPOTrainer in this process: its update records, and with ``--profile`` the op table."""
    model_dir, tokenizer = prepare(args)
    profiler = new_profiler(args)
    records = run_trl(gate, model_dir, tokenizer, queries, args, profiler)
    return {"records": records, "ops": op_table(profiler, args)}


def new_profiler(args):
    """With ``--profile``, a not-yet-started CPU profiler for the timed updates; else None."""
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if args.profile else None


def op_table(profiler, args) -> str | None:
    """The profiler's top ops by self CPU time (it cannot leave the process, its table can)."""
    if profiler is None:
        return None
    return profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows)


def peak_cell(results: dict[str, list[dict]], key: str) -> str:
    """The side's peak memory, and its ratio to the full fine-tune's (``shared``) when both ran."""
    peak = results[key][0].get("peak_bytes")
    if peak is None:
        return "n/a"
    full = results.get("shared", [{}])[0].get("peak_bytes")
    ratio = f" ({peak / full:.2f}x full)" if full and key != "shared" else ""
    return f"{peak / 2**30:.2f} GiB{ratio}"


# --------------------------------------------------------------------------------------------
def main(argv=None) -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument(
        "--updates", type=int, default=3, help="timed PPO updates per implementation (after 1 warmup update)"
    )
    parser.add_argument("--batch", type=int, default=16, help="episodes per update")
    parser.add_argument("--microbatch", type=int, default=16, help="episodes per forward/backward (both sides)")
    parser.add_argument("--query-tokens", type=int, default=64)
    parser.add_argument("--response-tokens", type=int, default=24)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument(
        "--freeze-layers",
        type=int,
        default=0,
        help="ppo.freeze_layers of ours (0: full fine-tune; K > 0 runs the trunk split: the sampling pass's "
        "activation entering block K feeds the reference forward and every PPO epoch); TRL always fine-tunes all",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="ours only on cuda (bf16 autocast, TF32, as compute.device auto picks); TRL runs on CPU",
    )
    parser.add_argument(
        "--only",
        choices=["shared", "lora", "separate", "trl"],
        action="append",
        help="run only these sides (repeatable; lora runs only when named)",
    )
    parser.add_argument("--lora-rank", type=int, default=8, help="the lora side's ppo.lora.rank (all linear layers)")
    parser.add_argument(
        "--recompute-logits",
        action="store_true",
        help="ppo.recompute_logits on our sides: the backward makes the LM head's logits again instead of keeping them",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="run each side under torch.profiler (timed updates only) and append its top ops by self CPU time; "
        "timings then include profiler overhead",
    )
    parser.add_argument("--profile-rows", type=int, default=30, help="rows of the --profile op table")
    parser.add_argument(
        "--order",
        choices=["sequential", "interleaved"],
        default="sequential",
        help="sequential (the default): each side's process runs all its updates, then the next side's starts, so "
        "one side's models are in memory at a time; interleaved: every side loads, then they take turns an update "
        "at a time, so the machine's drift falls on all alike (needs the memory of all sides at once: about 20 GB "
        "for shared, separate and TRL on SmolLM2)",
    )
    args = parser.parse_args(argv)
    if args.batch % args.microbatch:
        parser.error("--microbatch must divide --batch")
    if args.device == "cuda" and (not args.only or "trl" in args.only):
        parser.error("--device cuda times this project only: add --only shared and/or --only separate")

    model_dir, tokenizer = prepare(args)
    queries = random_token_ids(
        tokenizer, (args.batch * (args.updates + 1), args.query_tokens), torch.Generator().manual_seed(args.seed)
    )

    sides = {
        "shared": (
            "rlhf_pipeline PPOTrainer, value_model shared (reference)",
            (side_ours, (queries, args, "shared")),
        ),
        "lora": (
            f"rlhf_pipeline PPOTrainer, value_model shared, LoRA rank {args.lora_rank}",
            (side_ours, (queries, args, "shared", args.lora_rank)),
        ),
        "separate": (
            "rlhf_pipeline PPOTrainer, value_model separate (TRL-like)",
            (side_ours, (queries, args, "separate")),
        ),
        "trl": ("TRL 1.12 experimental PPOTrainer", (side_trl, (queries, args))),
    }
    chosen = [key for key in sides if (not args.only and key != "lora") or (args.only and key in args.only)]
    print(f"[ppo_throughput] {', '.join(chosen)}, {args.order}, each in a process of its own", file=sys.stderr)
    measured, _order = run_in_turns(
        {key: sides[key][1] for key in chosen}, steps=args.updates + 1, interleaved=args.order == "interleaved"
    )
    results: dict[str, list[dict]] = {key: side.extra["records"] for key, side in measured.items()}
    timed_usage = {key: side.usage[1:] for key, side in measured.items()}  # the gate's spans, warm-up left out
    profiles = {key: side.extra["ops"] for key, side in measured.items() if side.extra["ops"] is not None}
    trl_optimizer = results["trl"][0]["trl_optimizer"] if "trl" in results else "n/a"
    for key, records in results.items():
        print(
            f"[ppo_throughput] {key} update times: {[round(u['update'], 2) for u in records]}",
            file=sys.stderr,
            flush=True,
        )

    median = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    timed = {k: v[1:] for k, v in results.items()}
    sec = {k: median(v, "update") for k, v in timed.items()}
    flops = {k: v[0]["flops"] for k, v in results.items()}
    rows = []
    for key, rows_ in timed.items():
        ratio = f"{sec['trl'] / sec[key]:.2f}x" if "trl" in sec else "n/a"
        flop_ratio = f"{flops['trl'] / flops[key]:.2f}x" if "trl" in flops else "n/a"
        phase_cells = [f"{median(rows_, p):.2f}" for p in PHASES]
        rows.append(
            [
                sides[key][0],
                f"{args.batch / sec[key]:.2f}",
                f"{sec[key]:.2f}",
                ratio,
                f"{flops[key] / 1e9:.4g}",
                f"{flops[key] / 1e9 / sec[key]:.0f}",
                flop_ratio,
                *phase_cells,
                f"{results[key][0]['update']:.2f}",
                peak_cell(results, key),
            ]
        )
    headers = [
        "implementation",
        "episodes/s",
        "s/update",
        "speed vs TRL",
        "matmul GFLOP/update",
        "GFLOP/s",
        "vs TRL at equal GFLOP/s",
        "generation s",
        "ref+value fwd s",
        "reward s",
        "PPO epochs s",
        "other s",
        "warmup update s",
        "peak memory",
    ]
    table = render_table(headers, rows, args.markdown)
    usage_line = "page faults a timed update (median; minor faults, and the system time the process spent) and " + (
        "the times the bound on kept memory gave freed memory back over the timed updates: "
        + "; ".join(
            "{}: {:.0f} faults, {:.2f} s, given back {} times".format(key, *median_usage(spans))
            for key, spans in timed_usage.items()
        )
    )
    steal_line = steal_note(timed_usage, "updates")
    model_name = MODEL_NAMES[args.model]
    notes = [
        f"workload: {args.batch} episodes/update, query {args.query_tokens} tokens (fixed-seed random ids, no "
        f"padding), {args.response_tokens} sampled tokens "
        f"(temperature 0.7, no stop token), 1 minibatch, microbatch {args.microbatch}, 4 PPO epochs, "
        + (
            f"ours with the lowest {args.freeze_layers} blocks frozen (trunk split), TRL full fine-tune"
            if args.freeze_layers
            else "full fine-tune"
        )
        + f", lr {args.lr}; "
        f"1 warmup update + {args.updates} timed updates per side (medians of the timed updates).",
        "ours: task truncate_token '.' after 16 tokens (scoring only), KL adaptive init 0.15, whitened rewards, "
        "Adam eps 1e-5; no checkpointing; "
        + ("ppo.recompute_logits (the backward makes the LM head's logits again); " if args.recompute_logits else "")
        + "peak memory: on CUDA torch.cuda.max_memory_allocated over the side's run, on the CPU the side's process's "
        "peak resident memory (VmHWM: weights, Python and the allocator's kept memory included); "
        "torch deterministic algorithms not enabled (the train_policy stage enables them; no measurable effect on "
        "CPU expected).",
        f"TRL: per_device_train_batch_size {args.microbatch} x gradient_accumulation_steps "
        f"{args.batch // args.microbatch}, num_mini_batches 1, "
        f"local_rollout_forward_batch_size {args.batch}, stop_token None, missing_eos_penalty None, kl_coef 0.15, "
        "whiten_rewards, optimizer "
        f"{trl_optimizer}, no gradient checkpointing, report_to none, "
        "num_sample_generations 0.",
        "phases: generation = sampling; ref+value fwd = frozen reference forward (+ the value model's forward for "
        "separate/TRL); reward = reward-model "
        "scoring; PPO epochs = ours time/training (forward+backward+step of all epochs), TRL the wrapped training "
        "forward + accelerator.backward + "
        "optimizer.step; other = update time minus those (advantages, loss arithmetic, logging, TRL's "
        "gc.collect/empty_cache).",
        "speed vs TRL = TRL s/update / implementation s/update (>1 means faster than TRL).",
        f"order: {args.order}; each side in a process of its own (spawned), "
        + (
            "all loaded first, then one update of each in turn."
            if args.order == "interleaved"
            else "one after the other, each alone in memory."
        ),
        "matmul GFLOP/update: the warm-up update's matrix products, forward and backward (torch.utils.flop_counter."
        "FlopCounterMode; counting slows the warm-up update, which the ratios do not use); GFLOP/s: those over the "
        "median s/update; vs TRL at equal GFLOP/s = TRL's FLOPs / the side's: the speed ratio if both sides ran "
        "their matrix products at one rate, which only fewer FLOPs per update can raise.",
        usage_line,
        steal_line,
    ]
    if "lora" in results:
        notes.append(
            f"lora: ppo.lora rank {args.lora_rank} (alpha 16) on every linear layer of every block, the base weights "
            "frozen; the reference is the policy with its adapter switched off (no second model loaded), as the "
            "train_policy stage runs it."
        )
    if args.profile:
        notes.append(
            "PROFILED RUN: every side ran under torch.profiler during the timed updates, so their timings include "
            "profiler overhead."
        )
    report = render_report("PPO throughput", environment_lines(model_name, args.device), table, notes, args.markdown)
    for key, ops in profiles.items():
        heading = f"torch.profiler, {sides[key][0]}: top ops by self CPU time over {args.updates} timed update(s)"
        report += f"\n## {heading}\n\n```\n{ops}\n```\n" if args.markdown else f"\n{heading}\n{ops}\n"
    emit(report, args.output)


if __name__ == "__main__":
    main()
