"""The producer's view of a caller's connection, whatever its kind.

:func:`enqueue` and friends accept a psycopg 3 ``Connection``, a psycopg2 connection, a
SQLAlchemy 2 ``Session`` or ``Connection`` (psycopg 3 or psycopg2 driver), and in their async
forms a psycopg 3 ``AsyncConnection`` or a SQLAlchemy ``AsyncSession``/``AsyncConnection``
(psycopg driver). Each is reduced here to the driver connection underneath, seen through a small
view: its autocommit flag, its libpq transaction status, a way to run one statement and a way to
open a transaction of our own. The statements themselves come from
:meth:`~outbox_celery.produce.writes.ProducerWrites.write_plan`, one plan for every kind, so
validation, key locks and inserts cannot differ between them.

SQLAlchemy and psycopg2 are optional: they are imported only when the caller passes one of their
objects (recognized by the package its class comes from), never otherwise.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any

import psycopg

from ..db import rows as _rows
from ..db.follow_ups import FOLLOW_UPS, FollowUps, Noted
from ..errors import ProducerError
from ..table import TableName
from .writes import Statement, WritePlan

__all__ = [
    "FOLLOW_UPS",
    "AsyncView",
    "FollowUps",
    "Noted",
    "SyncView",
    "async_view",
    "drive",
    "drive_async",
    "note_follow_ups",
    "sync_view",
]

# libpq's PGTransactionStatusType, which psycopg 3 and psycopg2 both report.
IDLE = 0
INERROR = 3

_KINDS = (
    "a psycopg 3 Connection, a psycopg2 connection, or a SQLAlchemy 2 Session or Connection "
    "(postgresql+psycopg:// or postgresql+psycopg2://)"
)
_ASYNC_KINDS = (
    "a psycopg 3 AsyncConnection or a SQLAlchemy AsyncSession/AsyncConnection (postgresql+psycopg://)"
)


class _View:
    """What the transaction check needs: read once, before anything is written."""

    kind: str
    autocommit: bool
    status: int


class SyncView(_View):
    """A synchronous driver connection (psycopg 3 or psycopg2)."""

    def fetch(self, statement: Statement) -> list[Any]:  # pragma: no cover - abstract
        """Run one statement in the connection's transaction; its rows, read as it says
        (:class:`~outbox_celery.produce.writes.Statement`)."""
        raise NotImplementedError

    def own_transaction(self) -> AbstractContextManager[None]:  # pragma: no cover - abstract
        """A transaction of our own (only for an autocommit write the caller allowed)."""
        raise NotImplementedError


class AsyncView(_View):
    """An asynchronous driver connection (psycopg 3 ``AsyncConnection``)."""

    async def fetch(self, statement: Statement) -> list[Any]:  # pragma: no cover
        """Run one statement in the connection's transaction; its rows, read as it says
        (:class:`~outbox_celery.produce.writes.Statement`)."""
        raise NotImplementedError

    def own_transaction(self) -> AbstractAsyncContextManager[None]:  # pragma: no cover
        """A transaction of our own (only for an autocommit write the caller allowed)."""
        raise NotImplementedError


class _Psycopg(SyncView):
    def __init__(self, conn: psycopg.Connection[Any], kind: str) -> None:
        self.conn, self.kind = conn, kind
        self.autocommit = bool(conn.autocommit)
        self.status = int(conn.info.transaction_status)

    def fetch(self, statement: Statement) -> list[Any]:
        # A cursor of our own: the caller's row factory (dict_row...) is theirs.
        with self.conn.cursor(row_factory=statement.row_factory()) as cur:
            cur.execute(statement.query, statement.params)
            return cur.fetchall()

    @contextlib.contextmanager
    def own_transaction(self) -> Iterator[None]:
        with self.conn.transaction():
            yield


class _Psycopg2(SyncView):
    def __init__(self, conn: Any, kind: str) -> None:
        self.conn, self.kind = conn, kind
        self.autocommit = bool(conn.autocommit)
        self.status = int(conn.info.transaction_status)

    def fetch(self, statement: Statement) -> list[Any]:
        import psycopg2.extensions

        # psycopg2 speaks the same %(name)s placeholders; identifiers are quoted by psycopg's
        # sql module (no connection needed for that), values stay bound parameters.
        with self.conn.cursor(cursor_factory=psycopg2.extensions.cursor) as cur:
            cur.execute(statement.query.as_string(None), statement.params)
            if statement.row is None:
                return [tuple(r) for r in cur.fetchall()]
            make = _rows.maker(statement.row, [column.name for column in cur.description])
            return [make(r) for r in cur.fetchall()]

    @contextlib.contextmanager
    def own_transaction(self) -> Iterator[None]:
        # psycopg2 has no transaction block object; in autocommit mode BEGIN/COMMIT are plain
        # statements.
        with self.conn.cursor() as cur:
            cur.execute("BEGIN")
            try:
                yield
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            cur.execute("COMMIT")


class _AsyncPsycopg(AsyncView):
    def __init__(self, conn: psycopg.AsyncConnection[Any], kind: str) -> None:
        self.conn, self.kind = conn, kind
        self.autocommit = bool(conn.autocommit)
        self.status = int(conn.info.transaction_status)

    async def fetch(self, statement: Statement) -> list[Any]:
        async with self.conn.cursor(row_factory=statement.row_factory()) as cur:
            await cur.execute(statement.query, statement.params)
            return await cur.fetchall()

    @contextlib.asynccontextmanager
    async def own_transaction(self) -> AsyncIterator[None]:
        async with self.conn.transaction():
            yield


def _packages(obj: Any) -> set[str]:
    """Top-level packages of the classes ``obj`` is an instance of (no import needed)."""
    return {cls.__module__.partition(".")[0] for cls in type(obj).__mro__}


def _is_psycopg2(obj: Any) -> bool:
    return "psycopg2" in _packages(obj)


def _driver_view(driver: Any, kind: str) -> SyncView:
    if isinstance(driver, psycopg.Connection):
        return _Psycopg(driver, kind)
    if _is_psycopg2(driver):
        return _Psycopg2(driver, kind)
    raise ProducerError(
        f"{kind} runs on the {type(driver).__module__} driver; the outbox needs psycopg 3 "
        "(postgresql+psycopg://) or psycopg2 (postgresql+psycopg2://)"
    )


def sync_view(conn: Any) -> SyncView:
    """The view of any synchronous connection kind; :class:`ProducerError` for anything else."""
    if isinstance(conn, psycopg.Connection):
        return _Psycopg(conn, "psycopg Connection")
    packages = _packages(conn)
    if "sqlalchemy" in packages:
        return _sqlalchemy_sync(conn)
    if "psycopg2" in packages:
        return _Psycopg2(conn, "psycopg2 connection")
    if isinstance(conn, psycopg.AsyncConnection):
        raise ProducerError("an AsyncConnection needs enqueue_async / enqueue_many_async")
    raise ProducerError(
        f"expected {_KINDS}, got {type(conn).__name__} (Django users: see docs/integrations.md)"
    )


def _sqlalchemy_sync(obj: Any) -> SyncView:
    from sqlalchemy.engine import Connection
    from sqlalchemy.exc import InvalidRequestError
    from sqlalchemy.orm import Session

    kind = f"SQLAlchemy {type(obj).__name__}"
    if isinstance(obj, Session):
        try:
            # The Session's connection in its current transaction; a Session with autobegin
            # (the default) begins one here, exactly as its next execute() would.
            obj = obj.connection()
        except InvalidRequestError as exc:
            raise ProducerError(
                f"the Session has no transaction: use `with session.begin():` ({exc})"
            ) from None
    if not isinstance(obj, Connection):
        if type(obj).__name__.startswith("Async"):
            raise ProducerError(f"a {kind} needs enqueue_async / enqueue_many_async")
        raise ProducerError(f"expected {_KINDS}, got {kind}")
    if obj.closed or obj.invalidated:
        raise ProducerError(f"the {kind} is closed")
    if not obj.in_transaction():
        # What the Connection's next execute() would do ("commit as you go"): without it the
        # row would sit in a database transaction SQLAlchemy does not know about, and its
        # commit() would not commit it.
        obj.begin()
    return _driver_view(obj.connection.driver_connection, kind)


async def async_view(conn: Any) -> AsyncView:
    """The view of any asynchronous connection kind; :class:`ProducerError` for anything else."""
    if isinstance(conn, psycopg.AsyncConnection):
        return _AsyncPsycopg(conn, "psycopg AsyncConnection")
    if "sqlalchemy" in _packages(conn):
        return await _sqlalchemy_async(conn)
    if isinstance(conn, psycopg.Connection) or _is_psycopg2(conn):
        raise ProducerError(f"a {type(conn).__name__} is synchronous: use enqueue / enqueue_many")
    raise ProducerError(f"expected {_ASYNC_KINDS}, got {type(conn).__name__}")


async def _sqlalchemy_async(obj: Any) -> AsyncView:
    from sqlalchemy.exc import InvalidRequestError
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    kind = f"SQLAlchemy {type(obj).__name__}"
    if isinstance(obj, AsyncSession):
        try:
            obj = await obj.connection()
        except InvalidRequestError as exc:
            raise ProducerError(
                f"the AsyncSession has no transaction: use `async with session.begin():` ({exc})"
            ) from None
    if not isinstance(obj, AsyncConnection):
        raise ProducerError(f"a {kind} is synchronous: use enqueue / enqueue_many")
    if obj.closed or obj.invalidated:
        raise ProducerError(f"the {kind} is closed")
    if not obj.in_transaction():
        await obj.begin()  # as its next execute() would (see _sqlalchemy_sync)
    raw = await obj.get_raw_connection()
    driver = raw.driver_connection
    if not isinstance(driver, psycopg.AsyncConnection):
        raise ProducerError(
            f"{kind} runs on the {type(driver).__module__} driver; the async outbox producer needs "
            "psycopg 3 (postgresql+psycopg://)"
        )
    return _AsyncPsycopg(driver, kind)


def drive(view: SyncView, plan: WritePlan) -> list[int]:
    """Run a write plan's statements on ``view``, in order; what the plan returns."""
    statement = next(plan)
    while True:
        rows = view.fetch(statement)
        try:
            statement = plan.send(rows)
        except StopIteration as done:
            ids: list[int] = done.value
            return ids


async def drive_async(view: AsyncView, plan: WritePlan) -> list[int]:
    """:func:`drive` for an async connection."""
    statement = next(plan)
    while True:
        rows = await view.fetch(statement)
        try:
            statement = plan.send(rows)
        except StopIteration as done:
            ids: list[int] = done.value
            return ids


def note_follow_ups(view: _View, table: TableName, ids: list[int]) -> None:
    """``ids`` were inserted into ``table`` through ``view``: noted when its connection is being
    watched (a transactional handler's, :data:`~outbox_celery.db.follow_ups.FOLLOW_UPS`); only a
    psycopg 3 connection ever is."""
    if ids and isinstance(view, _Psycopg):
        FOLLOW_UPS.note(view.conn, table, ids)
