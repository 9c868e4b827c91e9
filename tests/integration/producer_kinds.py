"""Every kind of connection a producer may hold, opened on a test database (sync and async).

Each kind yields a :class:`Handle`: what the application passes to ``enqueue``, plus how the
application writes its business row, commits and rolls back with that kind.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row

BUSINESS = "INSERT INTO business (note) VALUES ('x')"


@dataclass
class Handle:
    """A producer's connection of one kind."""

    conn: Any
    execute: Callable[[str], Any]
    commit: Callable[[], Any]
    rollback: Callable[[], Any]


def sqlalchemy_url(dsn: str, driver: str) -> Any:
    """A SQLAlchemy URL for ``dsn`` with the given driver (``psycopg``, ``psycopg2``)."""
    from sqlalchemy.engine import URL

    p = conninfo_to_dict(dsn)
    return URL.create(
        f"postgresql+{driver}",
        username=p.get("user"),
        password=p.get("password"),
        host=p.get("host"),
        port=int(p["port"]) if p.get("port") else None,
        database=p.get("dbname"),
    )


@contextlib.contextmanager
def psycopg_kind(dsn: str, autocommit: bool = False, **kwargs: Any) -> Iterator[Handle]:
    with psycopg.connect(dsn, autocommit=autocommit, **kwargs) as c:
        yield Handle(c, c.execute, c.commit, c.rollback)


@contextlib.contextmanager
def psycopg2_kind(dsn: str, autocommit: bool = False) -> Iterator[Handle]:
    import psycopg2

    c = psycopg2.connect(dsn)
    c.autocommit = autocommit
    try:

        def execute(q: str) -> None:
            with c.cursor() as cur:
                cur.execute(q)

        yield Handle(c, execute, c.commit, c.rollback)
    finally:
        c.close()


@contextlib.contextmanager
def sqlalchemy_kind(dsn: str, driver: str, what: str, autocommit: bool = False) -> Iterator[Handle]:
    from sqlalchemy import create_engine, text
    from sqlalchemy.orm import Session

    kwargs: dict[str, Any] = {"isolation_level": "AUTOCOMMIT"} if autocommit else {}
    engine = create_engine(sqlalchemy_url(dsn, driver), **kwargs)
    try:
        if what == "session":
            with Session(engine) as session:
                yield Handle(session, lambda q: session.execute(text(q)), session.commit, session.rollback)
        else:
            with engine.connect() as conn:
                yield Handle(conn, lambda q: conn.execute(text(q)), conn.commit, conn.rollback)
    finally:
        engine.dispose()


SYNC_KINDS: dict[str, Callable[..., contextlib.AbstractContextManager[Handle]]] = {
    "psycopg": psycopg_kind,
    "psycopg-dict-rows": lambda dsn, autocommit=False: psycopg_kind(dsn, autocommit, row_factory=dict_row),
    "psycopg2": psycopg2_kind,
    "sqlalchemy-session-psycopg": lambda dsn, autocommit=False: sqlalchemy_kind(
        dsn, "psycopg", "session", autocommit
    ),
    "sqlalchemy-connection-psycopg": lambda dsn, autocommit=False: sqlalchemy_kind(
        dsn, "psycopg", "connection", autocommit
    ),
    "sqlalchemy-session-psycopg2": lambda dsn, autocommit=False: sqlalchemy_kind(
        dsn, "psycopg2", "session", autocommit
    ),
    "sqlalchemy-connection-psycopg2": lambda dsn, autocommit=False: sqlalchemy_kind(
        dsn, "psycopg2", "connection", autocommit
    ),
}


@dataclass
class AsyncHandle:
    """An async producer's connection of one kind."""

    conn: Any
    execute: Callable[[str], Awaitable[Any]]
    commit: Callable[[], Awaitable[Any]]
    rollback: Callable[[], Awaitable[Any]]


@contextlib.asynccontextmanager
async def async_psycopg_kind(dsn: str, autocommit: bool = False) -> AsyncIterator[AsyncHandle]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=autocommit) as c:
        yield AsyncHandle(c, c.execute, c.commit, c.rollback)


@contextlib.asynccontextmanager
async def async_sqlalchemy_kind(dsn: str, what: str, autocommit: bool = False) -> AsyncIterator[AsyncHandle]:
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    kwargs: dict[str, Any] = {"isolation_level": "AUTOCOMMIT"} if autocommit else {}
    engine = create_async_engine(sqlalchemy_url(dsn, "psycopg"), **kwargs)
    try:
        if what == "session":
            async with AsyncSession(engine) as session:
                yield AsyncHandle(
                    session, lambda q: session.execute(text(q)), session.commit, session.rollback
                )
        else:
            async with engine.connect() as conn:
                yield AsyncHandle(conn, lambda q: conn.execute(text(q)), conn.commit, conn.rollback)
    finally:
        await engine.dispose()


ASYNC_KINDS: dict[str, Callable[..., contextlib.AbstractAsyncContextManager[AsyncHandle]]] = {
    "psycopg-async": async_psycopg_kind,
    "sqlalchemy-asyncsession-psycopg": lambda dsn, autocommit=False: async_sqlalchemy_kind(
        dsn, "session", autocommit
    ),
    "sqlalchemy-asyncconnection-psycopg": lambda dsn, autocommit=False: async_sqlalchemy_kind(
        dsn, "connection", autocommit
    ),
}
