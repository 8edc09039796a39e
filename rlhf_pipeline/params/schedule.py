"""``schedule``: when the Prefect ``retrain`` deployment runs (read by the flow, by no stage)."""

from __future__ import annotations

import datetime as dt
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadDateError, croniter
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
        fields = value.split()
        if len(fields) != 5 or not croniter.is_valid(value) or any(f.upper() in ("R", "H") for f in fields):
            raise ValueError(
                "not a 5-field cron expression such as '0 3 * * 1' (minute hour day-of-month month day-of-week)"
            )
        # a valid cron can still name a day that never comes (30 February) or comes every four
        # years (29 February): a retraining schedule must fire within the coming year
        start = dt.datetime.now(dt.UTC).replace(tzinfo=None)
        try:
            following = croniter(value, start).get_next(dt.datetime)
        except (CroniterBadDateError, ValueError):  # croniter gives up searching after some years
            following = None
        if following is None or following - start > dt.timedelta(days=366):
            raise ValueError("does not fire within the next year (e.g. 30 or 29 February): check the day fields")
        return value

    @field_validator("timezone")
    @classmethod
    def _known_timezone(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError("not an IANA time zone name such as 'UTC' or 'Europe/Paris'") from None
        return value
