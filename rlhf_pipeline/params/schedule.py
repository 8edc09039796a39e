"""``schedule``: when the Prefect ``retrain`` deployment runs (read by the flow, by no stage)."""

from __future__ import annotations

from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter
from pydantic import Field, field_validator

from rlhf_pipeline.params import Strict


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
        if not croniter.is_valid(value) or any(field.upper() in ("R", "H") for field in value.split()):
            raise ValueError(
                "not a 5-field cron expression such as '0 3 * * 1' (minute hour day-of-month month day-of-week)"
            )
        return value

    @field_validator("timezone")
    @classmethod
    def _known_timezone(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError("not an IANA time zone name such as 'UTC' or 'Europe/Paris'") from None
        return value
