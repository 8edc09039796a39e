"""``ppo``: the PPO run that trains the policy against the normalised reward model."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import Field, model_validator

from rlhf_pipeline.params import MAX_BATCH, MAX_ROWS, MAX_SMALL, Strict, refuse

# Where each reference value comes from, pinned to a commit: OpenAI's code (its launch.py sets the
# sentiment task's values over train_policy.py's defaults) and lm-human-preference-details' PyTorch port.
OAI = "https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66"
OAI_POLICY, OAI_LAUNCH = f"{OAI}/lm_human_preferences/train_policy.py", f"{OAI}/launch.py"
DETAILS = (
    "https://github.com/vwxyzjn/lm-human-preference-details/blob/ccc19538e817e98a60d3253242ac15e2a562cb49/"
    "lm_human_preference_details/train_policy_accelerate.py"
)


class KLParams(Strict):
    """The KL penalty ``-beta * (log pi - log rho)`` on each response token, and how beta adapts."""

    adaptive: bool = Field(
        True,
        description=f"Adapt the coefficient towards kl.target (reference: on, {OAI_LAUNCH}#L130); false: a "
        "fixed coefficient init_coef.",
    )
    init_coef: float = Field(
        0.15,
        ge=0.0,
        description=f"The KL coefficient beta at the start (reference 0.15: {OAI_LAUNCH}#L129, {DETAILS}#L41).",
    )
    target: float = Field(
        6.0,
        gt=0.0,
        description="The per-response KL (nats) the adaptive controller steers to (reference 6.0: "
        f"{OAI_LAUNCH}#L131, {DETAILS}#L35).",
    )
    horizon: int = Field(
        10000,
        gt=0,
        le=MAX_ROWS,
        description="Episodes over which the adaptive controller closes its (clipped at +-20%) proportional error "
        f"(reference 10000: {OAI_POLICY}#L28, the controller at #L115-L125).",
    )
    budget: float | None = Field(
        None,
        gt=0.0,
        description="Keep the policy's KL to the reference within this many nats: after each rollout, a "
        "least-squares line through the last budget_window rollouts' mean KL forecasts the KL after one more "
        "update; when the forecast passes the budget, the current policy's KL is read precisely (on "
        "budget_check_responses more responses), and once that reading is over the budget the run ends with "
        "the policy before the last update, or part of the way through it when budget_backtracks finds one "
        "within the budget (rlhf_pipeline.ppo.kl.kl_budget_verdict). null: every update runs (the reference).",
    )
    budget_window: int = Field(
        4,
        ge=1,
        le=MAX_SMALL,
        description="Rollouts the budget's line is fitted to: one rollout's mean KL over a few dozen episodes "
        "is noisy (a per-response KL's standard deviation is several nats), the line averages that out.",
    )
    budget_check_responses: int = Field(
        128,
        ge=0,
        le=MAX_ROWS,
        description="Responses (to train queries, one each) sampled from the current policy, besides its "
        "rollout's, for the budget's precise reading of its KL; 0: the rollout's own mean. Taken only when "
        "the forecast passes the budget or the last reading was close to it; each costs about "
        "budget_check_responses / batch_size rollouts' sampling.",
    )
    budget_backtracks: int = Field(
        0,
        ge=0,
        le=MAX_SMALL,
        description="When the policy after an update reads over the budget, try the policies 1/2, 1/4, ... of "
        "that update's way from the one before it (the backtracking line search TRPO runs for its KL "
        "constraint), up to this many, each read precisely, and keep the first within the budget; 0 (or none "
        "within): the policy before the update. One late update moves the policy 1-2 nats here, so the policy "
        "before it can sit far under the budget.",
    )

    budget_search: Literal["halve", "bisect"] = Field(
        "halve",
        description="How the budget_backtracks tries choose their fractions (rlhf_pipeline.ppo.kl."
        "budget_line_search): halve: 1/2, 1/4, ..., keeping the first within the budget (TRPO's backtracking); "
        "bisect: after a fraction within, try further along (1/2, then 3/4 or 1/4, ...) and keep the largest "
        "within, which lands within 2^-budget_backtracks of the step's largest fraction within the budget "
        "instead of up to half a step under it; it reads every fraction on the same responses' draw, so the "
        "boundary it finds is the step's, not the samples'.",
    )

    @model_validator(mode="after")
    def _backtracks_need_readings(self) -> KLParams:
        if self.budget_backtracks and not self.budget_check_responses:
            refuse(
                [
                    (
                        "budget_backtracks",
                        "needs ppo.kl.budget_check_responses > 0: each try is read on those responses",
                        self.budget_backtracks,
                    )
                ]
            )
        return self

    estimator: Literal["k1", "k3"] = Field(
        "k1",
        description=f"Per-token KL estimator: k1 = log pi - log rho, the reference ({OAI_POLICY}#L150, "
        f"{DETAILS}#L630); k3 = (r - 1) - log r with r = rho / pi, unbiased and never negative (Schulman 2020).",
    )


class LoraParams(Strict):
    """A LoRA adapter (peft) on the policy instead of a full fine-tune: the reference log-probs come
    from the same model with the adapter off (no second copy), and models/policy is saved merged."""

    rank: int = Field(8, gt=0, le=MAX_SMALL, description="LoRA rank r.")
    alpha: float = Field(
        16.0,
        gt=0.0,
        le=MAX_SMALL,
        description="LoRA alpha: the update is scaled by alpha / rank (peft's default is 8; a scale in the "
        "thousands already overflows the first steps).",
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input.")
    # an empty list adapts nothing: peft then stops with NoMatchingPeftModuleError at the stage
    target_modules: (
        Literal["all-linear"] | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
    ) = Field(
        "all-linear",
        description="'all-linear': every linear layer of the transformer blocks (not the LM head); or a list of "
        "module names (e.g. [q_proj, v_proj]). Only the blocks above ppo.freeze_layers get an adapter.",
    )


# The one table of estimator names: ppo.advantage takes these; rlhf_pipeline.ppo.advantages holds one
# function per name (tests/test_ppo.py checks that the two agree).
AdvantageEstimator = Literal["gae", "rloo", "grpo"]
ADVANTAGE_ESTIMATORS = get_args(AdvantageEstimator)
CRITIC_FREE = ("rloo", "grpo")  # estimators that learn no value function


class PPOParams(Strict):
    """PPO on the policy against the normalised reward model: each field's default is the reference
    value (lm-human-preferences' sentiment run) where the reference has one, with the line it follows."""

    total_episodes: int = Field(
        1_000_000,
        gt=0,
        le=MAX_ROWS,
        description="Episodes over the whole run, all processes together (reference 1,000,000: "
        f"{OAI_LAUNCH}#L123, {DETAILS}#L49).",
    )
    batch_size: int = Field(
        512,
        gt=0,
        le=MAX_BATCH,
        description="Episodes per rollout/update over all processes (global, as in lm-human-preference-details): "
        "with N processes each samples and scores a contiguous batch_size/N, and the rollout is gathered, so "
        "advantages, whitening and the KL controller see the whole batch and every step equals the one-process step "
        f"(reference 512: {OAI_LAUNCH}#L124).",
    )
    nminibatches: int = Field(
        1,
        gt=0,
        le=MAX_BATCH,
        description="Optimizer steps per PPO epoch; each minibatch (batch_size/nminibatches) is global too "
        f"(reference 1: {OAI_POLICY}#L50, {DETAILS}#L62).",
    )
    microbatch_size: int = Field(
        512,
        gt=0,
        le=MAX_BATCH,
        description="Episodes per forward/backward on one process (gradient accumulation); memory, not maths. "
        "With N processes it must divide batch_size/nminibatches/N (reference: no accumulation, "
        f"{DETAILS}#L54).",
    )
    rollout_microbatch_size: int | None = Field(
        None,
        gt=0,
        le=MAX_BATCH,
        description="Responses per forward in a rollout, on one process: the sampling pass and the value, "
        "reference and reward-model forwards run over the process's share of batch_size in pieces of this many "
        "rows, one after another (less memory at once; each row still gets its own sampling draw, so the "
        "responses are the ones one pass samples, to the rounding of products over fewer rows). null: the whole "
        "share in one pass, as the reference samples its batch. A one-process run with this at batch_size/N "
        "computes every row in the shapes N processes do, so it samples what they sample on any CPU, even one "
        "whose matrix products round a row differently in a larger batch (docs/distributed.md). Must be a "
        "multiple of samples_per_query and divide batch_size/N.",
    )
    ppo_epochs: int = Field(
        4,
        gt=0,
        le=MAX_SMALL,
        description=f"Passes over each rollout (reference 4, noptepochs: {OAI_POLICY}#L51, {DETAILS}#L63).",
    )
    lr: float = Field(
        1.0e-5, gt=0.0, description=f"Adam's learning rate (reference 1e-5: {OAI_LAUNCH}#L122, {DETAILS}#L64)."
    )
    anneal_lr: bool = Field(
        True,
        description="Anneal the learning rate linearly to 0 over the updates (reference: on, "
        f"{OAI_POLICY}#L172-L173, {DETAILS}#L555-L557).",
    )
    adam_eps: float = Field(1.0e-5, gt=0.0, description=f"Adam's epsilon (reference 1e-5: {DETAILS}#L65).")
    tensorflow_adam: bool = Field(
        True,
        description="Adam with epsilon added to sqrt(v) before bias correction (TensorFlow, OAI); false: "
        f"torch.optim.Adam (reference: on, {DETAILS}#L122).",
    )
    max_grad_norm: float | None = Field(
        None,
        gt=0.0,
        description="Clip the gradient's global norm to this; null: no clipping (the reference clips nothing, "
        f"{OAI_POLICY}#L177).",
    )
    gamma: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description=f"Discount of GAE (reference 1: {OAI_POLICY}#L56, {DETAILS}#L69).",
    )
    lam: float = Field(
        0.95,
        ge=0.0,
        le=1.0,
        description=f"GAE's lambda (reference 0.95: {OAI_POLICY}#L57, {DETAILS}#L70).",
    )
    cliprange: float = Field(
        0.2, gt=0.0, description=f"PPO's ratio clip epsilon (reference 0.2: {OAI_POLICY}#L54, {DETAILS}#L67)."
    )
    cliprange_value: float = Field(
        0.2,
        gt=0.0,
        description="Clip of the value prediction around the rollout's value "
        f"(reference 0.2: {OAI_POLICY}#L55, {DETAILS}#L68).",
    )
    vf_coef: float = Field(
        0.1, ge=0.0, description=f"Weight of the value loss (reference 0.1: {OAI_POLICY}#L53, {DETAILS}#L66)."
    )
    entropy_coef: float = Field(
        0.0,
        ge=0.0,
        description=f"Weight of an entropy bonus; 0: none (the reference only logs the entropy, {OAI_POLICY}#L359).",
    )
    whiten_rewards: bool = Field(
        True,
        description="Whiten the rewards (no mean shift) before GAE (reference: on, "
        f"{OAI_POLICY}#L58 and #L324-L325, {DETAILS}#L71).",
    )
    advantage: AdvantageEstimator = Field(
        "gae",
        description="Advantage estimator: gae (a value head and GAE, the reference: "
        f"{OAI_POLICY}#L327-L338); rloo (each response's return "
        "minus the mean return of the other samples of its query) or grpo (the return standardised within its "
        "query's samples): critic-free, no value head, no value loss; both need samples_per_query >= 2.",
    )
    samples_per_query: int = Field(
        1,
        gt=0,
        le=MAX_SMALL,
        description="Responses sampled per query in a rollout (sharing one prefill), the group size of rloo and "
        "grpo; batch_size counts responses, so an update sees batch_size / samples_per_query queries. Reference: 1.",
    )
    lora: LoraParams | None = Field(None, description="null: full fine-tune (the reference); else a LoRA adapter.")
    seed: int | None = Field(
        None,
        ge=0,
        le=2**32 - 1,
        description="PPO's own random streams (episode order, sampling, minibatches); null: the root seed. Another "
        "value reruns PPO alone, on the same reward model and evaluation queries.",
    )
    kl: KLParams = Field(KLParams(), description="The KL penalty and its controller.")
    score_source: Literal["reward_model", "gold"] = Field(
        "reward_model",
        description="What scores a response: the trained reward model (the reference), or (an ablation, as Gao et "
        "al. 2022 do with their gold model) the simulated labeler's own score, standardised on the labelled "
        "base-model samples: what PPO reaches with a perfect reward on this budget. 'gold' needs "
        "data.preferences.source: simulated.",
    )
    value_model: Literal["shared", "separate"] = Field(
        "shared",
        description="shared: zero-init scalar head on the policy backbone (the reference: "
        f"{DETAILS}#L318); separate: a value model initialised from the reward model (TRL style).",
    )
    freeze_layers: int = Field(
        0,
        ge=0,
        le=MAX_SMALL,
        description="Freeze embeddings and the lowest K blocks of the policy (reference 0: all trained).",
    )
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Dropout in the policy while training (reference 0: OAI's policy runs without dropout, "
        f"{OAI}/lm_human_preferences/policy.py#L48).",
    )
    offload_frozen: bool = Field(False, description="Keep reference/reward models on CPU between uses.")
    recompute_logits: bool = Field(
        False,
        description="Memory: the training forward keeps no logits for the backward. The LM head runs under "
        "activation checkpointing in blocks of at most 64 MiB of fp32 logits and the backward makes each block's "
        "logits again, so a microbatch's peak memory loses its (rows x response tokens x vocabulary) copies for one "
        "more head forward (the head is about a fifth of SmolLM2-135M's forward FLOPs per token). The same "
        "values and gradients within rounding (blocks of other sizes). Not a reference detail (off: the logits "
        "are kept).",
    )
    checkpoint_every: int = Field(10, gt=0, le=MAX_ROWS, description="Updates between checkpoints.")
    deterministic: bool = Field(True, description="torch deterministic algorithms (bit-identical resume on CPU).")
    collective_timeout_s: float = Field(
        1800.0,
        gt=0.0,
        le=604_800.0,  # a week
        description="Several processes (`accelerate launch`): seconds one process waits in a collective "
        "(all-reduce, gather, barrier) for the others before the stage stops with an error naming this key; a "
        "process or machine that stopped answering would otherwise hold the rest forever. Not a reference "
        "detail (torch's gloo default, 1800); not part of the checkpoint's fingerprint, so a resume may change it.",
    )

    @model_validator(mode="after")
    def _batches_fit(self) -> PPOParams:
        problems = []
        if self.batch_size % self.nminibatches:
            problems.append(("nminibatches", f"must divide ppo.batch_size ({self.batch_size})", self.nminibatches))
        elif (minibatch := self.batch_size // self.nminibatches) % self.microbatch_size:
            problems.append(
                (
                    "microbatch_size",
                    f"must divide the minibatch size batch_size/nminibatches ({minibatch})",
                    self.microbatch_size,
                )
            )
        rollout_rows = self.rollout_microbatch_size
        if rollout_rows is not None and (rollout_rows % self.samples_per_query or self.batch_size % rollout_rows):
            problems.append(
                (
                    "rollout_microbatch_size",
                    f"must be a multiple of ppo.samples_per_query ({self.samples_per_query}: a piece holds whole "
                    f"groups of a query's samples) and divide ppo.batch_size ({self.batch_size})",
                    rollout_rows,
                )
            )
        if self.total_episodes < self.batch_size:
            problems.append(("total_episodes", f"must be >= ppo.batch_size ({self.batch_size})", self.total_episodes))
        if self.advantage in CRITIC_FREE and self.samples_per_query < 2:
            problems.append(
                (
                    "samples_per_query",
                    f"must be >= 2 for ppo.advantage {self.advantage!r} (its baseline is the other samples of the "
                    "same query)",
                    self.samples_per_query,
                )
            )
        if self.batch_size % self.samples_per_query:
            problems.append(
                (
                    "samples_per_query",
                    f"must divide ppo.batch_size ({self.batch_size}): a rollout holds whole groups of samples",
                    self.samples_per_query,
                )
            )
        if self.advantage in CRITIC_FREE and self.value_model == "separate":
            problems.append(
                (
                    "value_model",
                    f"'separate' builds a value model, which ppo.advantage {self.advantage!r} has no use "
                    "for; set it to 'shared' (ignored) or use ppo.advantage 'gae'",
                    self.value_model,
                )
            )
        refuse(problems)
        return self

    @property
    def critic_free(self) -> bool:
        return self.advantage in CRITIC_FREE

    def process_split_problem(self, world_size: int) -> str | None:
        """Why the batch cannot be shared by ``world_size`` processes (None when it can): each
        process takes an equal share of every minibatch, in microbatches, and whole groups of a
        query's ``samples_per_query`` responses (the critic-free baselines need the group together)."""
        share, rest = divmod(self.batch_size, self.nminibatches * world_size)
        queries = self.batch_size // self.samples_per_query
        if self.kl.budget is not None and self.kl.budget_check_responses % world_size:
            return (
                f"ppo.kl.budget_check_responses ({self.kl.budget_check_responses}) must split evenly over the "
                f"{world_size} processes"
            )
        if not rest and not share % self.microbatch_size and not queries % world_size:
            rollout_rows = self.rollout_microbatch_size
            if rollout_rows is not None and (self.batch_size // world_size) % rollout_rows:
                return (
                    f"ppo.rollout_microbatch_size ({rollout_rows}) must divide each process's share of "
                    f"ppo.batch_size ({self.batch_size} over {world_size} process(es))"
                )
            return None
        return (
            f"ppo.batch_size ({self.batch_size}) must split into ppo.nminibatches ({self.nminibatches}) minibatches, "
            f"each shared evenly by the {world_size} process(es) in shares that ppo.microbatch_size "
            f"({self.microbatch_size}) divides, and its {queries} queries (of ppo.samples_per_query "
            f"{self.samples_per_query} responses each) evenly over the processes"
        )
