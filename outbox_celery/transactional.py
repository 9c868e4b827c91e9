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

SQLAlchemy and Django are imported only by their kinds.
"""

from __future__ import annotations

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
    "transaction_kind",
]

#: The names ``transactional=`` accepts (``True`` means ``"psycopg"``).
KINDS = ("psycopg", "sqlalchemy", "django")

ConnectionSource = Callable[[], AbstractContextManager[psycopg.Connection[Any]]]


class TransactionKind(Protocol):
    """Opens the transaction a transactional handler runs in."""

    #: ``"psycopg"``, ``"sqlalchemy"`` or ``"django"`` (logs, errors).
    name: str

    def begin(
        self, connection: ConnectionSource
    ) -> AbstractContextManager[tuple[Any, psycopg.Connection[Any]]]:
        """A transaction: yields what the handler receives and the psycopg connection under it.

        Leaving the block normally commits; leaving it by an exception rolls back.

        :param connection: the outbox's pooled autocommit connections.
        """
        ...


class PsycopgTransaction:
    """A transaction on a connection of the outbox's pool; the handler gets that connection."""

    name = "psycopg"

    @contextmanager
    def begin(self, connection: ConnectionSource) -> Iterator[tuple[Any, psycopg.Connection[Any]]]:
        """See :meth:`TransactionKind.begin`."""
        with connection() as conn, conn.transaction():
            yield conn, conn


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
            raw = session.connection().connection.driver_connection
            if not isinstance(raw, psycopg.Connection):
                raise ConfigurationError(
                    "transactional='sqlalchemy' needs the psycopg 3 dialect (postgresql+psycopg://), "
                    f"got a {type(raw).__module__}.{type(raw).__name__} connection"
                )
            yield session, raw


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
        if not wrapper.in_atomic_block:
            # What Django does around each request: drop a connection that broke (a session
            # ended by a previous run's idle_in_transaction_session_timeout) or grew too old;
            # outside a request nothing else would, and every later run would fail on it.
            wrapper.close_if_unusable_or_obsolete()
        with transaction.atomic(using=alias):
            wrapper.ensure_connection()
            raw = wrapper.connection
            if not isinstance(raw, psycopg.Connection):
                raise ConfigurationError(
                    "transactional='django' needs Django's postgresql backend on psycopg 3, "
                    f"got a {type(raw).__module__}.{type(raw).__name__} connection"
                )
            yield wrapper, raw


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
