"""Transactional handlers (#24, DESIGN invariant 20): effect, fenced done and follow-ups commit together.

A handler registered with ``transactional=...`` receives ``(message, conn)`` and runs inside one
transaction on the outbox's database; the dispatcher writes the fenced ``done`` as the last
statement of that transaction, so the handler's writes, the follow-up events it enqueues on
``conn`` and the ``done`` commit together or not at all. A run whose claim was superseded (its
lease ran out and another claim took the row) fails the fence and rolls back, effect included.

Each *kind* opens that transaction on one sort of connection and hands the dispatcher the
psycopg 3 connection underneath, on which the store runs its statements:

* :class:`PsycopgTransaction` (``transactional=True`` or ``"psycopg"``): a connection of the
  outbox's own pool; the handler gets the :class:`psycopg.Connection`.
* :class:`SqlAlchemyTransaction` (``"sqlalchemy"`` with ``session_factory=``): a new
  :class:`sqlalchemy.orm.Session` inside ``session.begin()``; the handler gets the session. The
  engine must use the psycopg 3 dialect (``postgresql+psycopg://``) on the outbox's database.
* :class:`DjangoTransaction` (``"django"``, optionally ``using=``): ``transaction.atomic()`` on
  Django's connection (psycopg 3 backend); the handler gets that connection wrapper and may use
  the ORM.

Whatever kind, the connection the handler used is never used again after its run: the
psycopg one is closed before it goes back to the outbox's pool (the pool opens a new one),
SQLAlchemy's is invalidated as it goes back to its engine's pool (closed, replaced), Django's
is closed after ``atomic()`` (the next use connects again). A handler may leave session state
on it (``SET``, a row factory, adapters, ``LISTEN``, ``WITH HOLD`` cursors, a role, temporary
tables, a reference it kept): none of it reaches a later run, a claim or a finalizer (DESIGN
invariant 20).

SQLAlchemy and Django are imported only by their kinds.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import psycopg

from .errors import ConfigurationError

__all__ = [
    "KINDS",
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


class TransactionRolledBack(Exception):  # noqa: N818 - a fact, not a fault of the library
    """The handler returned, but its transaction will not commit (or was ended by the handler).

    Raised inside the transaction by a kind or the dispatcher (the transaction then rolls back),
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


class PsycopgTransaction:
    """A transaction on a connection of the outbox's pool; the handler gets that connection."""

    name = "psycopg"

    @contextmanager
    def begin(self, connection: ConnectionSource) -> Iterator[tuple[Any, psycopg.Connection[Any]]]:
        """See :meth:`TransactionKind.begin`."""
        with connection() as conn:
            try:
                with conn.transaction():
                    yield conn, conn
            finally:
                # Closed before the pool takes it back: the pool discards a closed connection
                # and opens another in the background (psycopg_pool), so whatever the handler
                # left on this one (session settings, row factory, adapters, LISTEN, cursors)
                # dies with it (DESIGN invariant 20).
                _DISCARDED.add(conn)
                conn.close()


class SqlAlchemyTransaction:
    """A new ``Session`` from ``session_factory`` inside ``session.begin()``; the handler gets it.

    :param session_factory: returns a :class:`sqlalchemy.orm.Session` (a ``sessionmaker``)
        bound to the outbox's database through the psycopg 3 dialect. The handler must not
        commit or roll back the session itself: the dispatcher commits after the fenced done.
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
                        "(transaction.set_rollback(True))"
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
