"""``promotion``: the gate a retrained policy passes before it replaces the one assigned ``prod``
(read by ``rlhf models gate`` and the retrain flow, by no stage)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from rlhf_pipeline.params import Seed, Strict, refuse

GateScore = Literal["gold", "proxy", "human"]


def plain_path(value: str) -> bool:
    """A project path as params may give one: relative, in forward slashes, no ``..``, ``.`` or empty parts
    (where its symbolic links lead is checked against the project where it is used)."""
    parts = value.split("/")
    return not value.startswith("/") and "\\" not in value and all(part not in ("", ".", "..") for part in parts)


JUDGE_LABELERS = ("vader",)  # the programmatic judges (rlhf_pipeline.labelers); anything else names a frozen judge
# a frozen judge by its registered version: pinned (NAME@vN), never a stage, which moves
REGISTERED_JUDGE = re.compile(r"[a-z0-9][a-z0-9-]*@v?\d+(?:\.\d+){0,2}")


class HumanGateParams(Strict):
    """``promotion.human``: the side-by-side round people answer when ``promotion.score`` is human."""

    num_queries: int = Field(
        64, ge=2, le=100_000, description="Held-out queries in a side-by-side round (one task each)."
    )
    seed: Seed = Field(0, description="The sampling seed of both models' responses (recorded in each task).")
    min_judgements: int = Field(
        64, ge=1, le=10_000_000, description="Fewest answers (ties included) the gate decides on; fewer: it waits."
    )
    min_annotators: int = Field(2, ge=1, le=10_000, description="Fewest different people among those answers.")
    tie_weight: float = Field(
        0.5, ge=0.0, le=1.0, description="What a tie counts as in the challenger's win rate (0.5: half a win)."
    )
    confidence: float = Field(
        0.95, gt=0.5, lt=1.0, description="The binomial (Wilson) interval's confidence around the win rate."
    )
    label_studio_project: int | None = Field(
        None,
        gt=0,
        description="The Label Studio project a waiting challenger's side-by-side tasks are sent to (rlhf label "
        "compare --send) and its answers pulled from (rlhf label verdicts --from-server), by the retrain flow around "
        "the gate ($LABEL_STUDIO_URL, $LABEL_STUDIO_API_KEY); null: the round goes through files (rlhf label "
        "compare, rlhf label verdicts).",
    )


class PromotionParams(Strict):
    score: GateScore = Field(
        "gold",
        description="What the rule compares: gold (the judge labeler's score of each response text), proxy "
        "(the challenger's reward model) or human (people's side-by-side verdicts, promotion.human). gold falls "
        "back to proxy, saying so, when judge is null.",
    )
    judge: str | None = Field(
        "vader",
        min_length=1,
        description="The gold judge, which scores response texts apart from where this round's labels came from, "
        "so a round of bad labels (noisy, adversarial) cannot vouch for itself: a labeler (vader), or a frozen "
        "judge: a reward model trained on golden_labels, as a folder in data/models/ (e.g. data/models/judge) or "
        "a registered version (reward-model@v1: pinned, fetched and checked when the gate runs). null: no gold.",
    )
    golden_labels: str | None = Field(
        None,
        min_length=1,
        description="The golden label set a frozen judge is trained and measured on, kept apart: no retrain run "
        "and no `rlhf label import` writes to it, and data.preferences.source may not be it.",
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
        description="Largest KL to the base model (nats: the evaluation's kl/exact_mean, or kl/mean where it has "
        "none) a promoted policy may have; "
        "null: no limit. The default run ends near the adaptive controller's target of 6.",
    )
    min_queries: int = Field(
        32, ge=2, le=10_000_000, description="Fewest paired held-out queries the comparison may rest on."
    )
    human: HumanGateParams = HumanGateParams()

    @model_validator(mode="after")
    def _paths_stay_in_the_project(self) -> PromotionParams:
        for name in ("judge", "golden_labels"):
            value = getattr(self, name)
            if value is not None and (name == "golden_labels" or value.startswith("data/")) and not plain_path(value):
                refuse([(name, "must be a path inside the project: relative, without '..', '.' or empty parts", value)])
        return self

    @model_validator(mode="after")
    def _judge_is_a_labeler_or_a_model_folder(self) -> PromotionParams:
        judge = self.judge
        if (
            judge is not None
            and judge not in JUDGE_LABELERS
            and not judge.startswith("data/models/")
            and not REGISTERED_JUDGE.fullmatch(judge)
        ):
            wanted = f"one of {list(JUDGE_LABELERS)}, null, a reward model folder in data/models/, or a version NAME@vN"
            refuse([("judge", f"must be {wanted}", judge)])
        return self

    @property
    def frozen_judge(self) -> str | None:
        """The judge's model folder, when the judge is a frozen reward model."""
        return self.judge if self.judge is not None and self.judge not in JUDGE_LABELERS else None
