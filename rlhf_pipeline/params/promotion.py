"""``promotion``: the gate a retrained policy passes before it replaces the one assigned ``prod``
(read by ``rlhf models gate`` and the retrain flow, by no stage)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlhf_pipeline.params import Strict

GateScore = Literal["gold", "proxy"]


class PromotionParams(Strict):
    score: GateScore = Field(
        "gold",
        description="What the rule compares: gold (the judge labeler's score of each response text) or proxy "
        "(the challenger's reward model). gold falls back to proxy, saying so, when judge is null.",
    )
    judge: Literal["vader"] | None = Field(  # the labelers of rlhf_pipeline.labelers
        "vader",
        description="The gold judge: a labeler that scores response texts apart from where the labels came from, "
        "so a round of bad labels (noisy, adversarial) cannot vouch for itself. null: no gold (human-only tasks).",
    )
    tolerance_se: float = Field(
        2.0,
        ge=0.0,
        le=100.0,
        description="The challenger may be worse than prod by at most this many paired standard errors.",
    )
    max_kl: float | None = Field(
        10.0,
        gt=0.0,
        le=1.0e6,
        description="Largest KL to the base model (nats, the evaluation's kl/mean) a promoted policy may have; "
        "null: no limit. The default run ends near the adaptive controller's target of 6.",
    )
    min_queries: int = Field(
        32, ge=2, le=10_000_000, description="Fewest paired held-out queries the comparison may rest on."
    )
