"""Transactional handlers (DESIGN invariant 20): effect, fenced done and follow-ups commit together.

A handler registered with ``transactional=...`` receives ``(message, conn)`` and runs inside one
transaction on the outbox's database; the deliverer writes the fenced ``done`` as the last
statement of that transaction, so the handler's writes, the follow-up events it enqueues on
``conn`` and the ``done`` commit together or not at all. A run whose claim was superseded (its
lease ran out and another claim took the row) fails the fence and rolls back, effect included.

Each *kind* opens that transaction on one sort of connection and hands the deliverer the
psycopg 3 connection underneath, on which the store runs its statements:

* :class:`PsycopgTransaction` (``transactional=True`` or ``"psycopg"``): a connection of the
  outbox's own pool; the handler gets the :class:`psycopg.Connection`.
* :class:`SqlAlchemyTransaction` (``"sqlalchemy"`` with ``session_factory=``): a new
  :class:`sqlalchemy.orm.Session` inside ``session.begin()``; the handler gets the session. The
  engine must use the psycopg 3 dialect (``postgresql+psycopg://``) on the outbox's database.
* :class:`DjangoTransaction` (``"django"``, optionally ``using=``): ``transaction.atomic()`` on
  Django's connection (psycopg 3 backend); the handler gets that connection wrapper and may use
  the ORM.

Whatever kind, nothing a handler leaves on its connection (``SET``, a role, ``LISTEN``,
``WITH HOLD`` cursors, temporary tables, a row factory, adapters) reaches a later run, a claim
or a finalizer (DESIGN invariant 20): the psycopg one is reset before it goes back to the
outbox's pool, or closed (the pool opens a new one) when its Python side changed; SQLAlchemy's
is invalidated as it goes back to its engine's pool (closed, replaced); Django's is closed after
``atomic()`` (the next use connects again).

SQLAlchemy and Django are imported only by their kinds.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import psycopg
from psycopg import pq

from .errors import ConfigurationError, OutboxError

__all__ = [
    "KINDS",
    "NOTHING_COMMITTED",
    "DjangoTransaction",
    "PsycopgTransaction",
    "SqlAlchemyTransaction",
    "TransactionKind",
    "TransactionRolledBack",
    "transaction_kind",
]

#: The names ``transactional=`` accepts (``True`` means ``"psycopg"``).
KINDS = ("psycopg", "sqlalchemy", "django")

ConnectionSource = Callable[[], AbstractContextManager[psycopg.Connection[Any]]]


#: How a rolled-back run's ``last_error`` ends.
NOTHING_COMMITTED = "; nothing it wrote was committed, nor its done"


class TransactionRolledBack(OutboxError):  # noqa: N818 - a fact, not a fault of the library
    """The handler returned, but its transaction will not commit (or was ended by the handler).

    Raised inside the transaction by a kind or the deliverer (the transaction then rolls back),
    and recorded as a retryable failure whose ``last_error`` says why: nothing the handler wrote
    committed, and neither did its ``done`` (DESIGN invariant 20).
    """


class TransactionKind(Protocol):
    """Opens the transaction a transactional handler runs in."""

    #: ``"psycopg"``, ``"sqlalchemy"`` or ``"django"`` (logs, errors).
    name: str

    def begin(
        self, connection: ConnectionSource
    ) -> AbstractContextManager[tuple[Any, psycopg.Connection[Any]]]:
        """A transaction: yields what the handler receives and the psycopg connection under it.

        Leaving the block normally commits; leaving it by an exception rolls back. Either way
        the connection is discarded afterwards, never handed to anyone else.

        :param connection: the outbox's pooled autocommit connections.
        """
        ...


# The pool connections closed here on purpose (PsycopgTransaction), while they go back to the
# pool: psycopg_pool warns about every closed connection it is given back ("discarding closed
# connection"), which would be one warning per transactional run.
_DISCARDED: weakref.WeakSet[Any] = weakref.WeakSet()
_POOL_DISCARDS_CLOSED = "discarding closed connection: %s"


class _QuietDiscards(logging.Filter):
    """Drop psycopg_pool's warning for the connections this module closed on purpose only."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (
            record.msg == _POOL_DISCARDS_CLOSED
            and isinstance(args, tuple)
            and len(args) == 1
            and args[0] in _DISCARDED
        )


logging.getLogger("psycopg.pool").addFilter(_QuietDiscards())


# The server side of a session back to its defaults, in one round trip: DISCARD ALL without its
# DEALLOCATE ALL, so psycopg's own prepared statements stay valid (a handler's settings, role,
# cursors, LISTENs, advisory locks, temporary tables, sequences' state and cached plans go).
# Several statements in one simple query: one implicit transaction, all or nothing.
SESSION_RESET = (
    "CLOSE ALL; SET SESSION AUTHORIZATION DEFAULT; RESET ALL; UNLISTEN *; "
    "SELECT pg_advisory_unlock_all(); DISCARD PLANS; DISCARD TEMP; DISCARD SEQUENCES"
)


def _identities(obj: Any) -> tuple[Any, ...] | None:
    """The identities of ``obj``'s attributes, one level into lists and dicts; ``None`` if
    unreadable.

    psycopg's adapter maps are copy-on-write: the first change made through a connection
    replaces the inner map it changes, so a changed identity means a changed map. Their
    ``_own*`` flags are left out: a cursor made from the map resets them, with no change.
    """
    state = getattr(obj, "__dict__", None)
    if not state:
        return None
    out: list[tuple[str, Any]] = []
    for name, value in sorted(state.items()):
        if name.startswith("_own"):
            continue
        if isinstance(value, dict):
            out.append((name, tuple((k, id(v)) for k, v in value.items())))
        elif isinstance(value, list):
            out.append((name, tuple(map(id, value))))
        else:
            out.append((name, id(value)))
    return tuple(out)


def _client_state(conn: psycopg.Connection[Any]) -> tuple[Any, ...] | None:
    """What a handler can change on the Python side of a psycopg connection, as identities:
    row and cursor factories, prepared-statement settings, adapters, notice and notify handlers.
    ``None`` when it cannot all be read (then nothing vouches for the connection)."""
    adapters = _identities(conn.adapters), _identities(conn.adapters.types)
    if None in adapters:
        return None
    return (
        id(conn.row_factory),
        id(conn.cursor_factory),
        id(conn.server_cursor_factory),
        conn.prepare_threshold,
        conn.prepared_max,
        adapters,
        tuple(map(id, getattr(conn, "_notice_handlers", ()))),
        tuple(map(id, getattr(conn, "_notify_handlers", ()))),
    )


def _reset(conn: psycopg.Connection[Any], before: tuple[Any, ...] | None) -> bool:
    """Reset a connection a handler used for its next user; ``False`` if that cannot be vouched
    for (then it must be discarded): broken, still in a transaction, its Python side changed, or
    the reset failed."""
    if before is None or conn.closed or conn.info.transaction_status != pq.TransactionStatus.IDLE:
        return False
    if _client_state(conn) != before:
        return False
    try:
        conn.execute(SESSION_RESET, prepare=False)
    except psycopg.Error:
        return False
    return conn.info.transaction_status == pq.TransactionStatus.IDLE


class PsycopgTransaction:
    """A transaction on a connection of the outbox's pool; the handler gets that connection.

    After the run, whatever its end, the connection is reset (``SESSION_RESET``, one round trip)
    when nothing on its Python side changed, else closed before the pool takes it back (the
    pool opens another): nothing a handler left on it reaches a later claim, finalizer or run
    (DESIGN invariant 20). A handler must not keep the connection past its run.
    """

    name = "psycopg"

    @contextmanager
    def begin(self, connection: ConnectionSource) -> Iterator[tuple[Any, psycopg.Connection[Any]]]:
        """See :meth:`TransactionKind.begin`."""
        with connection() as conn:
            before = _client_state(conn)
            try:
                with conn.transaction():
                    yield conn, conn
            finally:
                if not _reset(conn, before) and not conn.closed:
                    # Closed before the pool takes it back: the pool discards a closed
                    # connection and opens another in the background (psycopg_pool).
                    _DISCARDED.add(conn)
                    conn.close()


class SqlAlchemyTransaction:
    """A new ``Session`` from ``session_factory`` inside ``session.begin()``; the handler gets it.

    :param session_factory: returns a :class:`sqlalchemy.orm.Session` (a ``sessionmaker``)
        bound to the outbox's database through the psycopg 3 dialect. The handler must not
        commit or roll back the session itself: the deliverer commits after the fenced done.
    """

    name = "sqlalchemy"

    def __init__(self, session_factory: Callable[[], Any]) -> None:
        if not callable(session_factory):
            raise ConfigurationError("transactional='sqlalchemy' needs session_factory=, e.g. a sessionmaker")
        self.session_factory = session_factory

    @contextmanager
    def begin(self, connection: ConnectionSource) -> Iterator[tuple[Any, psycopg.Connection[Any]]]:
        """See :meth:`TransactionKind.begin`."""
        with self.session_factory() as session, session.begin():
            connection_ = session.connection()
            # Invalidated as it goes back to the engine's pool (after the commit): SQLAlchemy
            # closes it and opens another for the engine's next user, so nothing the handler
            # left on it reaches anyone (DESIGN invariant 20).
            _discard_on_checkin(connection_.engine)
            connection_.connection.info[_DISCARD] = True
            raw = connection_.connection.driver_connection
            if not isinstance(raw, psycopg.Connection):
                raise ConfigurationError(
                    "transactional='sqlalchemy' needs the psycopg 3 dialect (postgresql+psycopg://), "
                    f"got a {type(raw).__module__}.{type(raw).__name__} connection"
                )
            yield session, raw


# The mark, in a pooled SQLAlchemy connection's info (kept with its pool entry), of one a
# transactional handler used.
_DISCARD = "outbox_celery.discard"


def _discard_marked(dbapi_connection: Any, entry: Any) -> None:
    """A SQLAlchemy pool ``checkin`` listener: invalidate (close) a marked connection."""
    if entry is not None and entry.info.pop(_DISCARD, False):
        entry.invalidate()


def _discard_on_checkin(engine: Any) -> None:
    """Listen to ``engine``'s pool check-ins once (the listener survives ``dispose()``)."""
    from sqlalchemy import event

    if not event.contains(engine, "checkin", _discard_marked):
        event.listen(engine, "checkin", _discard_marked)


class DjangoTransaction:
    """``transaction.atomic()`` on Django's connection ``using``; the handler gets the connection.

    :param using: the Django database alias (default ``"default"``); it must be the outbox's
        database, on the psycopg 3 backend.
    """

    name = "django"

    def __init__(self, using: str | None = None) -> None:
        self.using = using

    @contextmanager
    def begin(self, connection: ConnectionSource) -> Iterator[tuple[Any, psycopg.Connection[Any]]]:
        """See :meth:`TransactionKind.begin`."""
        from django.db import DEFAULT_DB_ALIAS, connections, transaction

        alias = self.using or DEFAULT_DB_ALIAS
        wrapper = connections[alias]
        outermost = not wrapper.in_atomic_block
        if outermost:
            # What Django does around each request: drop a connection that broke or grew too
            # old (one the application used outside a run); outside a request nothing else would.
            wrapper.close_if_unusable_or_obsolete()
        try:
            with transaction.atomic(using=alias):
                wrapper.ensure_connection()
                raw = wrapper.connection
                if not isinstance(raw, psycopg.Connection):
                    raise ConfigurationError(
                        "transactional='django' needs Django's postgresql backend on psycopg 3, "
                        f"got a {type(raw).__module__}.{type(raw).__name__} connection"
                    )
                yield wrapper, raw
                if transaction.get_rollback(using=alias):
                    # atomic() would roll back without a word: the done would not commit.
                    raise TransactionRolledBack(
                        "the transactional handler marked its transaction for rollback "
                        f"(transaction.set_rollback(True)){NOTHING_COMMITTED}"
                    )
        finally:
            if outermost:
                # Closed after the transaction, as Django does at the end of a request with
                # CONN_MAX_AGE = 0: the next use connects again, so nothing the handler left on
                # this session reaches a later run (DESIGN invariant 20). A run inside an outer
                # atomic() (a caller's transaction) leaves the connection to that caller.
                wrapper.close()


def transaction_kind(
    transactional: bool | str,
    *,
    session_factory: Callable[[], Any] | None = None,
    using: str | None = None,
) -> TransactionKind | None:
    """The kind ``Outbox.handler(transactional=...)`` asks for; ``None`` for a plain handler.

    :raises ConfigurationError: an unknown kind, or an argument the kind does not take.
    """
    if transactional is False:
        kind = None
    elif transactional is True or transactional == "psycopg":
        kind = "psycopg"
    elif isinstance(transactional, str) and transactional in KINDS:
        kind = transactional
    else:
        raise ConfigurationError(
            f"transactional must be true, false or one of {KINDS}, got {transactional!r}"
        )
    if session_factory is not None and kind != "sqlalchemy":
        raise ConfigurationError("session_factory= goes with transactional='sqlalchemy'")
    if using is not None and kind != "django":
        raise ConfigurationError("using= goes with transactional='django'")
    if kind is None:
        return None
    if kind == "sqlalchemy":
        if session_factory is None:
            raise ConfigurationError("transactional='sqlalchemy' needs session_factory=, e.g. a sessionmaker")
        return SqlAlchemyTransaction(session_factory)
    if kind == "django":
        return DjangoTransaction(using)
    return PsycopgTransaction()
