"""A transactional handler's run (DESIGN invariant 20): its writes and the fenced done commit
together, in the transaction its kind opens (:mod:`outbox_celery.transactional`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import pq

from ..backoff import RetryPolicy
from ..config import OutboxConfig
from ..db.completer import Lease
from ..db.follow_ups import FOLLOW_UPS, Noted
from ..db.store import Store
from ..errors import ConfigurationError, RetryableError
from ..handlers import HandlerSpec
from ..message import Message, Outcome
from ..tracing import handler_span
from ..transactional import NOTHING_COMMITTED, TransactionKind, TransactionRolledBack
from .fence import FencedWrites
from .heartbeat import lease_heartbeat
from .verdict import Verdict, classify, error_text, ms_since, outcome_of

__all__ = ["TransactionalRun"]

logger = logging.getLogger(__name__)

# SQLSTATE class 40, transaction rollback: a deadlock (40P01) or a serialization failure
# (40001) between a transactional handler's transaction and another. Nothing was committed; the
# same run may well succeed a moment later.
_ROLLBACK_CLASS = "40"

# What a rolled-back run's last_error says when the handler raised psycopg.Rollback.
_RAISED_ROLLBACK = (
    "the transactional handler rolled back its transaction (psycopg.Rollback)" + NOTHING_COMMITTED
)


@dataclass(slots=True)
class _Progress:
    """How far a transactional run got: its handler called, its done written."""

    called: bool = False
    done: bool = False


class _Superseded(Exception):  # noqa: N818 - control flow inside this module only
    """A transactional run's fenced done changed nothing: roll its transaction back."""


def _transaction_ended(conn: psycopg.Connection[Any]) -> str | None:
    """Why the handler's transaction can no longer commit its done, read from libpq's state
    (no round trip); ``None`` while it is open and healthy."""
    status = conn.info.transaction_status
    if status == pq.TransactionStatus.IDLE:
        return (
            "the transactional handler ended its transaction itself (a COMMIT or ROLLBACK on its "
            "connection): its done was not written, what it wrote before may have committed"
        )
    if status == pq.TransactionStatus.INERROR:
        return (
            "a statement failed in the transactional handler's transaction and the handler went "
            f"on: the transaction could only roll back{NOTHING_COMMITTED}"
        )
    return None


def _transaction_conflict(exc: BaseException) -> psycopg.Error | None:
    """The psycopg error of class 40 behind ``exc`` (Django and SQLAlchemy wrap it), if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, psycopg.Error):
            state = current.sqlstate or ""
            return current if state.startswith(_ROLLBACK_CLASS) else None
        orig = getattr(current, "orig", None)  # SQLAlchemy's DBAPIError
        current = orig if isinstance(orig, BaseException) else current.__cause__
    return None


class TransactionalRun:
    """Runs transactional handlers of one worker process.

    :param retry: the wait after a retryable failure that carries no delay of its own.
    """

    def __init__(
        self,
        config: OutboxConfig,
        fence: FencedWrites,
        store: Store,
        retry: Callable[[], RetryPolicy],
    ) -> None:
        self.config = config
        self.fence = fence
        self.store = store
        self._retry = retry

    def __call__(
        self, spec: HandlerSpec, kind: TransactionKind, msg: Message, log: dict[str, Any]
    ) -> Outcome:
        """The handler in its transaction, the fenced done its last statement; the outcome.

        A failure before the handler is called (opening or bounding the transaction) is the
        library's, recorded as such. The transaction is bounded by ``task_time_limit``; the done
        is its last statement and durable (never batched, never relaxed: it commits the
        handler's effect). A done that loses the fence raises inside the transaction, which
        rolls the effect back. Any exception rolls back too; its outcome is then recorded in a
        separate fenced statement, as for a plain handler. An unclassified exception is
        recorded and re-raised.
        """
        started = time.monotonic()
        progress = _Progress()
        try:
            self._run(spec, kind, msg, log, progress)
        except _Superseded:
            outcome = Outcome.LOST_LEASE
        except BaseException as exc:
            if not progress.called and isinstance(exc, Exception):
                # The transaction could not be opened or bounded (or an ordered message met
                # another isolation level): the library's failure, not the handler's.
                self.fence.failed_before_handler([Lease(msg.id, msg.lease_version)], exc, log)
                raise
            outcome = self._failed(exc, msg, log, started)
        else:
            if progress.done:
                outcome = Outcome.DONE
            else:
                # The block ended without an exception and without the done: the handler raised
                # psycopg.Rollback, which the psycopg transaction swallows after rolling back.
                verdict = classify(self._rolled_back(msg, _RAISED_ROLLBACK, log), msg.attempts, self._retry())
                assert verdict is not None
                outcome = self._finish(verdict, msg)
        logger.info(
            "outbox id %s %s -> %s",
            msg.id,
            msg.route,
            outcome,
            extra={**log, "outcome": outcome, "transactional": kind.name, "duration_ms": ms_since(started)},
        )
        return outcome

    def _run(
        self, spec: HandlerSpec, kind: TransactionKind, msg: Message, log: dict[str, Any], progress: _Progress
    ) -> None:
        """The transaction: bounded, the handler, its follow-ups moved to its commit when it ran
        long, the fenced done last (``progress`` says how far it got)."""
        cfg = self.config
        with (
            lease_heartbeat(cfg, msg.extend_lease, log=log),
            handler_span(msg),
            kind.begin(self.fence.connection) as (handle, conn),
        ):
            isolation = self.store.limit_transaction(conn, seconds=cfg.task_time_limit)
            if msg.ordering_key is not None and isolation != "read committed":
                # The ordered done decides the key's next head from its statement's
                # snapshot, taken after the key lock only under read committed.
                raise ConfigurationError(
                    f"ordered messages need a READ COMMITTED transaction, the {kind.name} "
                    f"transactional handler of {msg.event_type!r} runs in {isolation}"
                )
            progress.called = True
            began = time.monotonic()
            with FOLLOW_UPS.watch(conn) as follow_ups:
                spec.fn(msg, handle)
            ended = _transaction_ended(conn)
            if ended is not None:
                raise TransactionRolledBack(ended)
            if follow_ups and time.monotonic() - began >= cfg.scan_lookback / 2:
                # A long transaction: its follow-ups would commit behind the claims' scan
                # marks, at its start; they move to its commit (invariant 18).
                self._follow_ups_at_commit(conn, follow_ups)
            done = Verdict(Outcome.DONE).finish(msg)
            if not self.fence.finish([done], conn=conn).of(msg.id).applied:
                raise _Superseded
            progress.done = True

    def _failed(self, exc: BaseException, msg: Message, log: dict[str, Any], started: float) -> Outcome:
        """A run that raised (its transaction rolled back): its outcome, written in a fenced
        statement of its own; an unclassified exception is recorded and re-raised."""
        conflict = _transaction_conflict(exc)
        if conflict is not None:
            exc = RetryableError(f"transaction conflict ({conflict.sqlstate}): {conflict}")
        elif isinstance(exc, TransactionRolledBack):
            exc = self._rolled_back(msg, str(exc), log)
        elif isinstance(exc, psycopg.Rollback):
            # Raised where no psycopg transaction() swallows it (the SQLAlchemy and Django
            # kinds): the transaction rolls back all the same.
            exc = self._rolled_back(msg, _RAISED_ROLLBACK, log)
        verdict = classify(exc, msg.attempts, self._retry())
        if verdict is None:
            error = Verdict(Outcome.ERROR, error=error_text(exc))
            self.fence.finish([error.finish(msg)])
            logger.error(
                "outbox id %s transactional handler raised %s; rolled back, row returns after its lease",
                msg.id,
                type(exc).__name__,
                extra={**log, "outcome": Outcome.ERROR, "duration_ms": ms_since(started)},
            )
            raise exc
        return self._finish(verdict, msg)

    def _finish(self, verdict: Verdict, msg: Message) -> Outcome:
        won = self.fence.finish([verdict.finish(msg)])
        return outcome_of(verdict, won.of(msg.id))

    @staticmethod
    def _rolled_back(msg: Message, why: str, log: dict[str, Any]) -> RetryableError:
        """The retryable failure of a run that returned but did not commit.

        Its done did not commit, ``why`` says why in ``last_error``; the row is back after a
        backoff with the attempt kept (``dead`` at ``max_attempts``, so a handler that always
        rolls back ends), never left to its lease (invariant 20).
        """
        logger.warning("outbox id %s: %s; retried after a backoff", msg.id, why, extra=log)
        return RetryableError(why)

    def _follow_ups_at_commit(self, conn: psycopg.Connection[Any], follow_ups: Noted) -> None:
        """Move a long transaction's follow-ups, table by table, to the time of its commit."""
        for table, ids in follow_ups.items():
            store = self.store if table == self.store.table else Store(table)
            store.follow_ups_at_commit(conn, ids)
