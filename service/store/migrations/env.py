"""Alembic environment for the control-plane store.

The API applies migrations itself at start (service/store/migrate.py hands over its connection
in `config.attributes["connection"]`). For writing a new revision by hand:
`alembic -c service/store/migrations/alembic.ini revision -m "..."` with ELASTRON_DATABASE_URL set
(or the default SQLite file), then `--autogenerate` compares against service/store/models.py.
"""

from __future__ import annotations

from alembic import context

from service.store.models import Base

config = context.config


def _configure_and_run(connection) -> None:
    # render_as_batch: SQLite cannot ALTER most things; batch mode rebuilds the table instead.
    context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def _run() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure_and_run(connection)
        return
    if context.is_offline_mode():
        context.configure(url=_url(), target_metadata=Base.metadata, literal_binds=True)
        with context.begin_transaction():
            context.run_migrations()
        return
    from service.store.db import make_engine

    engine = make_engine(_url())
    with engine.connect() as conn:
        _configure_and_run(conn)
        conn.commit()


def _url() -> str:
    from service.settings import Settings

    return config.get_main_option("sqlalchemy.url") or Settings().resolved_database_url


_run()
