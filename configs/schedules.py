"""Beat schedules: a YAML file of named schedules, each a cron expression (or a period in
seconds) and the synthesis spec it runs, validated with pydantic.

    nightly-stories:
      spec: synth/example.yaml     # relative to the schedules file's directory
      cron: "0 3 * * *"            # minute hour day-of-month month day-of-week (UTC)
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from celery.schedules import crontab
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from specq.schema.errors import InputError, describe


class ScheduleError(InputError):
    """The schedules file is invalid; each problem names the schedule and its field."""

    title = "invalid schedules"


class Schedule(BaseModel):
    """One named schedule: exactly one of cron, every."""

    model_config = ConfigDict(extra="forbid")

    name: str
    spec: Path = Field(description="synthesis spec (YAML), absolute once loaded")
    cron: str | None = Field(None, description="5 fields: minute hour day month weekday")
    every: float | None = Field(None, gt=0, description="seconds between firings instead")
    stuck_after: float = Field(
        86400.0, gt=0, description="seconds after which an unfinished run is stuck: each "
        "firing that meets it says so (an error in the log)")
    on_stuck: Literal["cancel", "skip"] = Field(
        "cancel", description="cancel: the stuck run is cancelled (finished items kept, its "
        "data set written) and a new run starts; skip: no new run while it is stuck")

    @field_validator("cron")
    @classmethod
    def _cron(cls, value: str | None) -> str | None:
        if value is not None:
            to_crontab(value)  # raises ValueError saying what is wrong
        return value

    @model_validator(mode="after")
    def _one_timing(self) -> Schedule:
        if (self.cron is None) == (self.every is None):
            raise ValueError("give exactly one of cron, every")
        return self

    def celery_schedule(self) -> crontab | float:
        if self.cron is not None:
            return to_crontab(self.cron)
        assert self.every is not None  # exactly one of the two (_one_timing)
        return float(self.every)


def to_crontab(expression: str) -> crontab:
    """A 5-field cron expression as a celery crontab; ValueError if it is not one."""
    fields = expression.split()
    if len(fields) != 5:
        raise ValueError(f"expected 5 fields (minute hour day month weekday), "
                         f"got {len(fields)} in {expression!r}")
    minute, hour, day, month, weekday = fields
    try:
        return crontab(minute=minute, hour=hour, day_of_month=day, month_of_year=month,
                       day_of_week=weekday)
    except (ValueError, IndexError, TypeError) as exc:
        raise ValueError(f"invalid expression {expression!r}: {exc}") from None


def load_schedules(path: Path) -> dict[str, Schedule]:
    """Every schedule of the file; ScheduleError names each bad one and its field."""
    path = Path(path)
    if not path.is_file():
        raise ScheduleError([f"{path}: file not found"])
    raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if not isinstance(raw, dict):
        raise ScheduleError([f"{path}: expected a mapping of schedule names"])
    schedules: dict[str, Schedule] = {}
    problems: list[str] = []
    for name, body in raw.items():
        if not isinstance(body, dict):
            problems.append(f"{path}: {name}: expected a mapping with spec and cron")
            continue
        try:
            schedule = Schedule(name=str(name), **body)
        except ValidationError as exc:
            problems += [f"{path}: {name}: {p}" for p in describe(exc)]
            continue
        schedule.spec = (path.resolve().parent / schedule.spec).resolve()
        schedules[schedule.name] = schedule
    if problems:
        raise ScheduleError(problems)
    return schedules
