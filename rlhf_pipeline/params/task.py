"""``task``: how responses are sampled and scored; shared by preference sampling, reward
normalisation, PPO and evaluation."""

from __future__ import annotations

from pydantic import Field, model_validator

from rlhf_pipeline.params import MAX_TOKENS, Strict, refuse


class TaskParams(Strict):
    chat: bool = Field(
        False,
        description="Chat task: queries are prompts rendered with the base model's chat template and generation "
        "prompt (data.queries.prompts), and responses stop at the template's end-of-turn token, which the reward "
        "model scores; false: the OAI text-continuation task on the corpus (reference).",
    )
    response_length: int = Field(24, gt=0, le=MAX_TOKENS)
    temperature: float = Field(0.7, gt=0.0)
    stop_at_eos: bool = Field(False, description="False: fixed-length sampling that ignores EOS (reference).")
    truncate_token: str | None = Field(".", description="Cut the response after this token; null disables.")
    truncate_after: int = Field(
        16, ge=0, le=MAX_TOKENS, description="Search for truncate_token from this response index on."
    )
    penalty_reward: float = Field(-1.0, description="Score of a response with no truncate_token.")

    @model_validator(mode="after")
    def _truncation_fits(self) -> TaskParams:
        if self.truncate_token is not None and self.truncate_after >= self.response_length:
            refuse(
                [("truncate_after", f"must be < task.response_length ({self.response_length})", self.truncate_after)]
            )
        return self
