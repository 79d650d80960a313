"""Infrastructure settings, read from SPECQ_* environment variables (and a .env file)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """One source of truth for where things are and how big they are."""

    model_config = SettingsConfigDict(env_prefix="SPECQ_", env_file=".env", extra="ignore")

    broker_url: str = "redis://127.0.0.1:6379/0"
    database_url: str | None = Field(
        None, description="SQLAlchemy URL; default: SQLite in data_dir (the embedded default)"
    )
    data_dir: Path = Path("data")
    presets_file: Path | None = Field(None, description="extra model-pair presets (YAML)")
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (float32 on CPU, bfloat16 on GPU) | float32 | bfloat16 | float16
    chunk_size: int = Field(64, ge=1)
    max_batch_size: int = Field(16, ge=1)
    # The job pipeline (worker/app.py, api/client.py).
    queue_prefix: str = Field("specq", description="prefix of every Celery queue name")
    visibility_timeout: int = Field(
        3600, ge=1, description="seconds before an unacknowledged chunk is redelivered; "
        "must exceed the longest chunk"
    )
    worker_pair: str | None = Field(None, description="the pair a worker serves (specq worker)")
    # Scheduled synthesis (worker/beat.py).
    schedules_file: Path = Field(
        Path(__file__).with_name("schedules.yaml"),
        description="beat schedules (YAML): cron expressions naming synthesis specs",
    )
    schedule_lock_ttl: int = Field(
        300, ge=1, description="seconds a schedule's firing lock lives if its holder dies"
    )

    @property
    def sqlalchemy_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'specq.db').resolve()}"


@lru_cache
def get_settings() -> Settings:
    return Settings()
