"""Stage train_policy: PPO against the normalised reward model -> models/policy (+ checkpoints)."""

from __future__ import annotations

import _interpreter  # noqa: F401  (first: exit 6 when this Python lacks the project's packages)

import rlhf_pipeline.offline  # noqa: F401  (first: offline and quiet before the Hugging Face libraries load)

from contextlib import nullcontext

import torch

from rlhf_pipeline import paths
from rlhf_pipeline.devices import DevicePlan, resolve_compute
from rlhf_pipeline.distributed import lost_processes_reported, make_accelerator, whole_model
from rlhf_pipeline.io import atomic_dir, content_hash, write_json
from rlhf_pipeline.labelers import gold_labeler
from rlhf_pipeline.logging import open_live, step_logger
from rlhf_pipeline.modelcard import preference_data_line, write_card
from rlhf_pipeline.models import load_tokenizer, require_context, require_dir
from rlhf_pipeline.params import StageParams
from rlhf_pipeline.params.compute import ComputeParams
from rlhf_pipeline.params.data import DataParams
from rlhf_pipeline.params.ppo import PPOParams
from rlhf_pipeline.params.task import TaskParams
from rlhf_pipeline.ppo.checkpoint import Checkpointer, fingerprint_of
from rlhf_pipeline.ppo.parts import trainer_parts
from rlhf_pipeline.ppo.policy import build_policy, require_fit, save_policy
from rlhf_pipeline.ppo.stats import history_summary
from rlhf_pipeline.ppo.trainer import PPOTrainer
from rlhf_pipeline.queries import load_queries
from rlhf_pipeline.reward.persistence import HEAD_FILE, load_reward_model
from rlhf_pipeline.runner import declared_code_hash, project_root, run_stage

BASE, REWARD, QUERIES, PREFS = paths.BASE_MODEL, paths.REWARD, paths.QUERIES, paths.PREFERENCES
OUT, CHECKPOINTS, METRICS, LIVE = paths.POLICY, paths.POLICY_CHECKPOINTS, paths.POLICY_METRICS, paths.POLICY_LIVE
RESUME = f"Its last checkpoint in {CHECKPOINTS} is kept: launch every process again and the stage resumes from it."
SPEED = paths.SPEED_METRICS


class Params(StageParams):
    compute: ComputeParams = ComputeParams()
    data: DataParams = DataParams()
    task: TaskParams = TaskParams()
    ppo: PPOParams = PPOParams()


def summary(cfg, episodes: int, device: str) -> str:
    """The card's first paragraph: how the policy was trained and where its parts are."""
    how = "PPO (lm-human-preferences details)"
    if cfg.critic_free:
        how += f" with the critic-free {cfg.advantage.upper()} advantage ({cfg.samples_per_query} samples per query)"
    if cfg.lora is not None:
        how += f" through a rank-{cfg.lora.rank} LoRA adapter, merged into the saved weights"
    parts = "; the value head is in `value_head.safetensors`." if not cfg.critic_free else "."
    return (
        f"`{BASE}` fine-tuned with {how} against `{REWARD}` for {episodes} episodes on {device}. Loads with "
        f"`AutoModelForCausalLM.from_pretrained`{parts}"
    )


def gold_statistics(path: str) -> tuple[float, float]:
    """Mean and std of the gold scores of the labelled base-model samples (ppo.score_source 'gold')."""
    from datasets import load_from_disk

    gold = torch.tensor([score for row in load_from_disk(path)["train"]["gold"] for score in row], dtype=torch.float64)
    return gold.mean().item(), gold.std().item()


def training_data(params: Params, num_queries: int) -> list[str]:
    """The card's Training data: the queries PPO sampled on, and what its score came from."""
    queries = f"{num_queries} train queries of `{QUERIES}` (no held-out query was trained on)."
    labels = preference_data_line(params.data.preferences.source, params.data.preferences.labeler)
    if params.ppo.score_source == "gold":
        return [queries, f"Scored by the `{params.data.preferences.labeler}` labeller itself (ppo.score_source: gold)."]
    return [queries, f"Scored by `{REWARD}`, the normalised reward model, trained on these labels:", labels]


def checkpoint_fingerprint(params: Params, plan: DevicePlan, uses_reward_model: bool) -> str:
    """Params, inputs, code and device of this run: a checkpoint of another version of any of them
    (one written on the CPU, resumed where compute.device auto now finds a GPU) is not resumed."""
    reward_hash = content_hash(f"{REWARD}/{HEAD_FILE}") if uses_reward_model else None
    return fingerprint_of(
        params.seed,
        params.ppo.model_dump(exclude={"collective_timeout_s"}),  # how long to wait changes no result
        params.task.model_dump(),
        reward_hash,
        content_hash(f"{QUERIES}"),
        declared_code_hash("train_policy", project_root()),
        params.compute.model_dump(),
        plan.describe(),
    )


def train(params: Params, plan: DevicePlan, accelerator, tokenizer, queries: torch.Tensor, uses_reward_model: bool):
    """Load the models, run PPO (resuming from a checkpoint of this run) and return the whole trained
    policy (None on processes other than 0), the history, the timings and the gold labeller."""
    cfg, is_main = params.ppo, accelerator.is_main_process
    frozen_device = "cpu" if cfg.offload_frozen else plan.device
    gold = gold_labeler(params.data.preferences.source, params.data.preferences.labeler)
    gold_standardization = gold_statistics(PREFS) if cfg.score_source == "gold" and gold is not None else None
    reward_model = load_reward_model(REWARD, frozen_device) if cfg.score_source == "reward_model" else None
    # DVCLive starts afresh every time: on a resume the trainer replays the checkpoint's history
    # into it first, so the series match an uninterrupted run's step for step
    with open_live(LIVE) if is_main else nullcontext() as live:
        parts = trainer_parts(
            BASE,
            cfg,
            params.task,
            params.seed if cfg.seed is None else cfg.seed,
            plan.device,
            queries,
            tokenizer,
            reward_model=reward_model,
            value_from=REWARD,
            frozen_device=frozen_device,  # with LoRA no reference is loaded: the adapter off is the reference
            checkpointer=Checkpointer(CHECKPOINTS, checkpoint_fingerprint(params, plan, uses_reward_model)),
            gold_labeler=gold,
            gold_standardization=gold_standardization,
            log=step_logger(live),
            autocast=plan.autocast if plan.autocast_dtype else None,
            cuda_sampler=plan.sampler,
        )
        trainer = PPOTrainer(parts, accelerator)
        history = trainer.train(progress=is_main)
    policy = whole_model(accelerator, parts.policy, lambda: build_policy(BASE, cfg, "cpu", REWARD))
    return policy, history, trainer.timings, gold, trainer.budget.stopped


def main(params: Params) -> None:
    cfg = params.ppo
    uses_reward_model = cfg.score_source == "reward_model" or cfg.value_model == "separate"
    require_dir(BASE, "base_model")
    plan = resolve_compute(params.compute, cfg.deterministic)
    # one process unless `accelerate launch` started several; refuses what it cannot honour, before loading
    accelerator = make_accelerator(
        plan.device,
        cfg.freeze_layers > 0,
        "train_policy",
        cfg.lora is not None,
        cfg.collective_timeout_s,
        timeout_key="ppo.collective_timeout_s",
    )
    require_fit(cfg, BASE, accelerator.num_processes)  # the model's depth, modules and widths, from its config
    if uses_reward_model:
        require_dir(REWARD, "normalize_reward", HEAD_FILE)
    is_main = accelerator.is_main_process
    if cfg.deterministic and plan.device.type == "cpu":  # on CUDA resolve_device set it (warning only)
        torch.use_deterministic_algorithms(True)
    tokenizer = load_tokenizer(BASE)
    queries = load_queries(QUERIES, "train", tokenizer.pad_token_id)
    require_context(BASE, queries.shape[1], params.task.response_length)
    # a process that dies or hangs stops the others with a clear error; the checkpoints keep the work
    with lost_processes_reported(accelerator, "train_policy", RESUME):
        policy, history, timings, gold, stopped = train(
            params, plan, accelerator, tokenizer, queries, uses_reward_model
        )
    if not is_main:
        return

    metrics = {"device": plan.describe(), **history_summary(history, with_gold=gold is not None)}
    if stopped is not None:  # ppo.kl.budget ended the run: where, and the kept policy's KL
        metrics["kl_budget"] = stopped
    # how long the updates this process ran took: a measurement of the machine, in SPEED only,
    # which no stage declares (dvc.yaml's top-level metrics), so no output and no dvc.lock hash
    # holds a timing and a rerun writes the same bytes; none when it resumed at the last update
    speed = {"episodes_per_second": sum(t.episodes_per_second for t in timings) / len(timings)} if timings else {}
    with atomic_dir(OUT, checksums=True) as tmp:
        save_policy(policy, tokenizer, tmp, params.task.temperature, params.task.response_length)
        write_card(
            tmp,
            target=OUT,
            chat_template=tokenizer.chat_template if params.task.chat else None,
            kind="policy",
            title="PPO policy",
            summary=summary(cfg, metrics["episodes"], plan.describe()),
            base_dir=BASE,
            datasets=[params.data.preferences.source],  # in the metadata when it is a hub id
            data=training_data(params, len(queries)),
            tags=["ppo", "rlhf", "policy"],
            hyperparameters={"ppo": cfg.model_dump(), "task": params.task.model_dump(), "seed": params.seed},
            metrics=metrics,
            inputs=[BASE, REWARD, QUERIES],
            device=plan.describe(),
        )
    write_json(METRICS, metrics)
    write_json(SPEED, speed)
    print(
        f"train_policy: {metrics['episodes']} episodes, score {metrics['score/first_quarter']:.3f} -> "
        f"{metrics['score/last_quarter']:.3f}, KL {metrics['kl/last_quarter']:.2f}"
    )


if __name__ == "__main__":
    run_stage("train_policy", main, Params)
