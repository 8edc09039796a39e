"""The evaluation's metric keys (``metrics/evaluate.json``): one home for the names the evaluate stage
writes and the registry, the version commands, the gate and the benches read."""

from __future__ import annotations


def gain(score: str) -> str:
    """``score``'s paired gain of the policy over the base, in base-model stds."""
    return f"{score}/improvement_in_base_std"


def gain_se(score: str) -> str:
    """The paired standard error of :func:`gain`."""
    return f"{score}/improvement_stderr_in_base_std"


def gain_undefined(score: str) -> str:
    """Why ``score``'s gain is null (the base's scores have no spread)."""
    return f"{score}/improvement_undefined"


QUERIES = "queries"  # held-out queries evaluated
GOLD_BASE_MEAN = "gold/base_mean"
GOLD_BASE_STD = "gold/base_std"
GOLD_POLICY_MEAN = "gold/policy_mean"
GOLD_QUERIES = "gold/queries"
RESPONSES_PER_QUERY = "responses_per_query"  # evaluate.responses_per_query: responses each model gave a query
GOLD_GAIN = gain("gold")  # the headline: the gold judge's gain over the base, in base stds
GOLD_GAIN_SE = gain_se("gold")  # its paired standard error
PROXY_BASE_MEAN = "proxy/base_mean"
PROXY_POLICY_MEAN = "proxy/policy_mean"
PROXY_GAIN = gain("proxy")  # the reward model's own gain (what PPO optimised)
PROXY_GAIN_SE = gain_se("proxy")
KL = "kl/mean"  # KL from the base model, nats per response (ppo.kl.estimator's; k1 by default)
KL_SE = "kl/stderr"  # its standard error over the held-out queries (each query's mean over its responses)
KL_EXACT = "kl/exact_mean"  # the same KL, each token's term exact over the vocabulary (ppo.kl.budget's measure)
KL_EXACT_SE = "kl/exact_stderr"  # its standard error (smaller than k1's: no draw of which token)
WIN_RATE_GOLD = "win_rate/gold"
WIN_RATE_PROXY = "win_rate/proxy"
RM_ACCURACY = "test/accuracy"  # metrics/reward_train.json: the reward model's held-out accuracy
