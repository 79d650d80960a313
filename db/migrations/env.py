"""Alembic environment: the URL comes from the caller (db.session.migrate) or the settings."""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context

from specq.db.models import Base

config = context.config
if config.config_file_name and "connection" not in config.attributes:
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    if "url" in config.attributes:
        return config.attributes["url"]
    from specq.configs.settings import get_settings

    return get_settings().sqlalchemy_url


def run_offline() -> None:
    context.configure(url=_url(), target_metadata=Base.metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    conn = config.attributes.get("connection")
    if conn is not None:
        context.configure(connection=conn, target_metadata=Base.metadata)
        with context.begin_transaction():
            context.run_migrations()
        return
    from specq.db.session import get_engine

    with get_engine(_url()).begin() as conn:
        context.configure(connection=conn, target_metadata=Base.metadata)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
