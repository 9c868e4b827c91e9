"""The worker's fenced writes: start, finish and extend, each one completer call, retried once
on a connection the server broke.

Every write of a delivery goes through :class:`FencedWrites`: the Deliverer's, a batch
handler's, a transactional handler's (inside its own transaction), the done batcher's and the
slot wake's. The completer (:mod:`outbox_celery.db.completer`) runs the one fenced statement
of each step (DESIGN invariant 4).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

import psycopg

from .. import outcomes
from ..backoff import Backoff
from ..config import OutboxConfig
from ..db.completer import FinalizedMany, Finish, Lease, Step
from ..db.pool import DatabaseUnavailable
from ..db.store import Store, starter_token
from ..errors import first_line
from ..message import Message
from .verdict import error_text

__all__ = ["PRE_HANDLER_FAILURE", "Connections", "FencedWrites"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How last_error starts when the library failed before the handler ran (never the handler's fault).
PRE_HANDLER_FAILURE = "outbox-celery failed before calling the handler (the handler did not run)"


class Connections(Protocol):
    """Where the worker's connections come from (a pool's ``connection``)."""

    def __call__(self) -> AbstractContextManager[psycopg.Connection[Any]]: ...


class FencedWrites:
    """The fenced writes of one worker process on one table.

    :param recover: called before a write is retried after a broken connection (the Outbox
        checks its pool's idle connections there).
    """

    def __init__(
        self,
        config: OutboxConfig,
        connection: Connections,
        store: Store,
        *,
        recover: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.connection = connection
        self.store = store
        self._recover = recover
        self._backoff = Backoff(config.backoff_base, config.backoff_cap)

    def start(
        self, leases: Sequence[Lease], *, undecodable: dict[int, Exception] | None = None
    ) -> list[Message]:
        """The fenced start of one lease or many: the started messages, sorted by id (a row whose
        payload cannot be decoded goes to ``undecodable`` when given, see ``Completer.start``)."""
        cfg = self.config
        # One token for the start and its retry: a retry after a lost reply gets its own start
        # back uncounted, while any other start of these claims is refused (invariant 3).
        starter = starter_token()
        return self._write(
            "start" if len(leases) == 1 else "start_many",
            leases[0],
            lambda conn: self.store.completer.start(
                conn,
                leases,
                lease=cfg.lease,
                max_attempts=cfg.max_attempts,
                starter=starter,
                undecodable=undecodable,
            ),
        )

    def finish(
        self,
        finishes: Sequence[Finish],
        *,
        notify: bool = False,
        conn: psycopg.Connection[Any] | None = None,
    ) -> FinalizedMany:
        """Every finalize of a delivery: the completer's one fenced statement.

        On its own connection, retried once when the server broke it; with ``conn`` as the last
        statements of that connection's open transaction (a transactional handler's, invariant
        20), which commits or rolls back as a whole. The logs name the write after its steps
        (:func:`outcomes.operation <outbox_celery.outcomes.operation>`).
        """
        cfg = self.config

        def write(c: psycopg.Connection[Any]) -> FinalizedMany:
            return self.store.completer.finish(
                c,
                finishes,
                max_attempts=cfg.max_attempts,
                max_age=cfg.max_defer_age,
                notify=notify,
                joined=conn is not None,
            )

        if conn is not None:
            return write(conn)
        return self._write(outcomes.operation(f.step for f in finishes), finishes[0].lease, write)

    def extend(self, leases: Sequence[Lease], seconds: float) -> bool:
        """The lease heartbeat of a delivery or a batch: true while any row of it holds its lease."""
        with self.connection() as conn:
            return bool(self.store.completer.extend(conn, leases, seconds=seconds))

    def extender(self, lease: Lease) -> Callable[[float], bool]:
        """The lease heartbeat's extension of one row (a message's ``extend_lease``)."""
        return lambda seconds: self.extend([lease], seconds)

    def failed_before_handler(self, leases: Sequence[Lease], exc: Exception, log: dict[str, Any]) -> None:
        """The library's own code failed between the claim and the handler: say so at once.

        Left alone, the rows would sit ``processing`` until their lease ran out with an empty
        ``last_error``. Instead the failure is written now, fenced, as a retryable one: back to
        ``pending`` after a short backoff with the attempt kept (the start may have counted
        it), ``dead`` once attempts are exhausted, ``last_error`` naming the library, not the
        handler. When the database is known to be unreachable (:class:`DatabaseUnavailable`),
        or even that write fails, the rows come back through their lease.
        """
        if isinstance(exc, DatabaseUnavailable):
            # Its lane fails every caller at once until the database answers: nothing to
            # write it on.
            logger.error(
                "outbox: %s row(s) from id %s: no connection to the database (%s); the handler did "
                "not run, the rows come back through their lease with no attempt spent",
                len(leases),
                leases[0].id,
                first_line(exc),
                extra={**log, "outcome": "error"},
            )
            return
        error = f"{PRE_HANDLER_FAILURE}: {error_text(exc)}"[:4000]
        retry = [Finish(x, Step.RETRY, self._backoff.delay(1), error) for x in leases]
        try:
            self.finish(retry)
        except Exception:
            logger.exception("outbox: could not record the failure before the handler", extra=log)
        logger.error(
            "outbox: %s row(s) from id %s: outbox-celery failed before calling the handler (%s: %s); "
            "the handler did not run, retried after a backoff",
            len(leases),
            leases[0].id,
            type(exc).__name__,
            exc,
            extra={**log, "outcome": "error"},
        )

    def _write(self, op: str, first: Lease, write: Callable[[psycopg.Connection[Any]], T]) -> T:
        """Run one fenced write; on a connection the server broke, once more on a checked one.

        A pooled connection may have been closed by the server since its last use (a restart,
        a failover, ``pg_terminate_backend``); recently used ones are not checked before use
        (IdleCheck). Retrying is safe: the write is fenced on the claim's ``lease_version`` and
        status, so whichever run lands first wins and a second changes nothing (DESIGN
        invariant 4); a start whose reply was lost after its commit is found again by its token
        and counts nothing more. A database known to be unreachable (:class:`DatabaseUnavailable`)
        is not retried: the rows come back through their lease.
        """
        try:
            with self.connection() as conn:
                return write(conn)
        except psycopg.OperationalError as exc:
            if isinstance(exc, DatabaseUnavailable):
                raise  # its lane refuses every caller until the database answers
            logger.warning(
                "outbox id %s: %s failed on a broken connection (%s); retrying once on a fresh one",
                first.id,
                op,
                first_line(exc),
                extra={"outbox_id": first.id, "lease_version": first.lease_version, "operation": op},
            )
        if self._recover is not None:
            self._recover()
        with self.connection() as conn:
            return write(conn)
