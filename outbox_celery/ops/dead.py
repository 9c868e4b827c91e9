"""Dead letters: list and show them, requeue them (deliver again) or skip them (never deliver).

What ``outbox-celery dead``, the console and the Django admin run. Writes say which rows they
changed and refuse ambiguous or wrong input with :class:`~outbox_celery.errors.AdminError`
before anything changes; :func:`requeue_all` runs each batch in its own short transaction, so it
needs a connection that is not inside a transaction already.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, NamedTuple, TypedDict, Unpack

import psycopg
from psycopg.rows import dict_row

from ..errors import AdminError
from ..table import TableName
from ._queries import many, outside_transaction, q, regclass, value, values
from .durations import format_duration

__all__ = [
    "MAX_REASON_LENGTH",
    "SKIPPED_BY_OPERATOR",
    "DeadFilters",
    "DeadMessage",
    "FailedAttempt",
    "count_dead",
    "failed_attempts",
    "get_message",
    "list_dead",
    "requeue",
    "requeue_all",
    "skip",
    "was_skipped",
]

logger = logging.getLogger(__name__)

#: The longest reason a requeue or skip records (a longer one is cut); ``last_error`` keeps
#: the previous error behind it.
MAX_REASON_LENGTH = 1000
#: How a skipped message's ``last_error`` starts: the row is ``done`` (its state machine has no
#: other end), and this tells it from a delivered one.
SKIPPED_BY_OPERATOR = "skipped by operator"


def was_skipped(status: str, last_error: str | None) -> bool:
    """Whether a row is ``done`` because an operator skipped it (:func:`skip`), not delivered."""
    return status == "done" and (last_error or "").startswith(SKIPPED_BY_OPERATOR + ": ")


@dataclass(frozen=True, slots=True)
class DeadMessage:
    """One row of :func:`list_dead`.

    :ivar age: seconds since ``created_at``.
    :ivar waiting_behind: messages of its ordering key after it that are not done (what it
        blocks if it is the head); 0 for unordered messages.
    """

    id: int
    event_type: str
    aggregate_type: str
    aggregate_id: str
    ordering_key: str | None
    attempts: int
    created_at: datetime
    age: float
    last_error: str | None
    waiting_behind: int

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        d = asdict(self)
        d["created_at"] = self.created_at.isoformat()
        return d


class DeadFilters(TypedDict, total=False):
    """Which dead messages :func:`list_dead` and :func:`count_dead` take; absent or ``None``
    matches every one. ``older_than``/``newer_than`` are seconds since ``created_at``."""

    event_type: str | None
    aggregate_type: str | None
    aggregate_id: str | None
    older_than: float | None
    newer_than: float | None


class _Locked(NamedTuple):
    """A row of ``lock_ids``: ``lease_in`` is the seconds until a processing row's lease ends."""

    id: int
    status: str
    lease_in: float | None


class _Skipped(NamedTuple):
    """A row of ``skip_ids``."""

    id: int
    ordering_key: str | None


def _dead_params(filters: DeadFilters) -> dict[str, Any]:
    """Every filter as a query parameter (``None`` where absent); unknown names raise."""
    unknown = set(filters) - set(DeadFilters.__annotations__)
    if unknown:
        raise TypeError(f"unknown dead-letter filter(s): {', '.join(sorted(unknown))}")
    return {name: filters.get(name) for name in DeadFilters.__annotations__}


def _dead_message(**row: Any) -> DeadMessage:
    return DeadMessage(**{**row, "id": int(row["id"]), "waiting_behind": int(row["waiting_behind"])})


def list_dead(
    conn: psycopg.Connection[Any],
    table: str | TableName = "outbox",
    *,
    after: int = 0,
    limit: int = 50,
    **filters: Unpack[DeadFilters],
) -> list[DeadMessage]:
    """Dead messages by id, filtered; page with ``after`` = the last id of the previous page.

    ``filters``: :class:`DeadFilters` (``event_type=``, ``older_than=`` ...).
    """
    if limit < 1:
        raise AdminError("limit must be at least 1")
    params = {**_dead_params(filters), "after": after, "limit": limit}
    return many(conn, q(table, "dead_list"), params, _dead_message)


def count_dead(
    conn: psycopg.Connection[Any],
    table: str | TableName = "outbox",
    **filters: Unpack[DeadFilters],
) -> int:
    """How many dead messages match the filters of :func:`list_dead`."""
    return int(value(conn, q(table, "dead_count"), _dead_params(filters)) or 0)


@dataclass(frozen=True, slots=True)
class FailedAttempt:
    """One entry of a message's ``errors`` (DESIGN invariant 32): a failed attempt.

    :ivar attempt: the row's ``attempts`` when it failed (the attempt's number since the last
        requeue).
    :ivar at: when it was recorded, by the database's clock.
    :ivar error: its error, cut to 1,000 characters (a lease that ran out after the start:
        ``lease expired without a result (worker lost or timed out)``).
    """

    attempt: int
    at: datetime
    error: str


def failed_attempts(errors: Sequence[Any] | None) -> list[FailedAttempt]:
    """A message's ``errors`` column (as :func:`get_message` returns it, oldest first) as
    :class:`FailedAttempt` entries, the latest first; empty when it never failed."""
    entries = [
        FailedAttempt(int(e["attempt"]), datetime.fromisoformat(str(e["at"])), str(e["error"]))
        for e in errors or ()
    ]
    return entries[::-1]


def get_message(
    conn: psycopg.Connection[Any], table: str | TableName, outbox_id: int
) -> dict[str, Any] | None:
    """Every column of one message (any status) plus what explains its state, or ``None``.

    ``errors`` is the column as stored: a list of ``{"attempt", "at", "error"}``, oldest
    first, the last 20 failed attempts (``None`` while it never failed; read it with
    :func:`failed_attempts`).
    Extra keys: ``now``, ``age`` (seconds since created), ``available_in`` and
    ``lease_expires_in`` (seconds from now, negative when past), ``key_head`` (the id of its
    ordering key's head, the unfinished message flagged ``head``; ``None`` when it has none) and
    ``waiting_behind`` (unfinished messages after it in its key).
    """
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(q(table, "show"), {"id": outbox_id}).fetchone()
    if row is not None:
        row["waiting_behind"] = int(row["waiting_behind"])
    return row


def _check_statuses(
    conn: psycopg.Connection[Any], table: str | TableName, ids: list[int], allowed: tuple[str, ...], verb: str
) -> None:
    """Lock ``ids`` and refuse (raise) unless every one exists with an allowed status.

    A ``processing`` row whose lease has expired is allowed too: no worker holds it (its task
    was lost, or its event type has no handler any more). A live lease is refused.
    """
    rows = many(conn, q(table, "lock_ids"), {"ids": ids}, _Locked)
    found = {int(r.id): str(r.status) for r in rows}
    lease_in = {int(r.id): r.lease_in for r in rows}
    missing = [i for i in ids if i not in found]
    if missing:
        raise AdminError(f"no message with id {', '.join(map(str, missing))} in {TableName.parse(table)}")
    live = [i for i in ids if found[i] == "processing" and ((left := lease_in[i]) is None or left > 0)]
    if live:
        raise AdminError(
            f"cannot {verb}: message {', '.join(map(str, live))} is processing under a live lease "
            f"(ends in {format_duration(math.ceil(max(lease_in[i] or 0.0 for i in live)))}; "
            "a worker may be running it): "
            "try again once the lease has expired"
        )
    wrong = [f"{i} is {found[i]}" for i in ids if found[i] not in (*allowed, "processing")]
    if wrong:
        past = {"requeue": "requeued", "skip": "skipped"}.get(verb, verb)
        raise AdminError(
            f"cannot {verb}: message {'; '.join(wrong)} (only {' or '.join(allowed)} messages, "
            f"or processing ones whose lease expired, can be {past})"
        )


def _ids(ids: Sequence[int]) -> list[int]:
    out = []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or i < 1:
            raise AdminError(f"invalid message id {i!r}")
        out.append(i)
    return sorted(set(out))


def _reason(reason: str | None, *, required: bool) -> str | None:
    if reason is None or not reason.strip():
        if required:
            raise AdminError("a reason is required")
        return None
    if "\x00" in reason:
        raise AdminError("the reason must not contain NUL characters")
    return reason.strip()[:MAX_REASON_LENGTH]


def requeue(
    conn: psycopg.Connection[Any],
    table: str | TableName,
    ids: Sequence[int],
    *,
    reason: str | None = None,
) -> list[int]:
    """Dead -> pending now, attempts reset, the previous error kept behind a prefix.

    A ``processing`` message whose lease has expired is requeued the same way (its task was
    lost, or its event type lost its handler); one under a live lease is refused.
    All or nothing: if any id is unknown or not dead, :class:`AdminError` is raised and nothing
    changes. Returns the requeued ids.
    """
    wanted = _ids(ids)
    if not wanted:
        raise AdminError("no message ids given")
    why = _reason(reason, required=False)
    with conn.transaction():
        _check_statuses(conn, table, wanted, ("dead",), "requeue")
        params = {"ids": wanted, "reason": why, "table": regclass(conn, table)}
        requeued = values(conn, q(table, "requeue_ids"), params)
    done = sorted(int(i) for i in requeued)
    logger.warning(
        "operator requeued %s dead message(s)",
        len(done),
        extra={"outcome": "requeued", "outbox_ids": done, "outbox_table": str(TableName.parse(table))},
    )
    return done


def requeue_all(
    conn: psycopg.Connection[Any],
    table: str | TableName = "outbox",
    *,
    event_type: str | None = None,
    reason: str | None = None,
    batch_size: int = 1000,
) -> int:
    """Requeue every dead message (of ``event_type``), in batches; returns how many.

    Each batch is its own short transaction; the loop moves forward by id, so a message that
    dies again while it runs is not requeued twice.
    """
    outside_transaction(conn, "requeue --all")
    if batch_size < 1:
        raise AdminError("batch_size must be at least 1")
    why = _reason(reason, required=False)
    total, after = 0, 0
    while True:
        with conn.transaction():
            requeued = values(
                conn,
                q(table, "requeue_batch"),
                {
                    "after": after,
                    "event_type": event_type,
                    "reason": why,
                    "limit": batch_size,
                    "table": regclass(conn, table),
                },
            )
        total += len(requeued)
        if len(requeued) < batch_size:
            break
        after = max(int(i) for i in requeued)
    logger.warning(
        "operator requeued %s dead message(s)",
        total,
        extra={"outcome": "requeued", "event_type": event_type, "outbox_table": str(TableName.parse(table))},
    )
    return total


def skip(
    conn: psycopg.Connection[Any],
    table: str | TableName,
    ids: Sequence[int],
    *,
    reason: str,
) -> list[int]:
    """Mark dead (or pending) messages done without delivering them, recording ``reason``.

    Used to unblock an ordered key whose head can never be delivered. A ``processing`` message
    is skipped only once its lease has expired (no worker holds it any more); under a live lease
    it is refused. All or nothing, like :func:`requeue`.
    """
    wanted = _ids(ids)
    if not wanted:
        raise AdminError("no message ids given")
    why = _reason(reason, required=True)
    with conn.transaction():
        # Key locks before row locks, as producers and the ordered done take them (invariant 9).
        table_regclass = regclass(conn, table)
        conn.execute(q(table, "lock_keys_of_ids"), {"table": table_regclass, "ids": wanted})
        _check_statuses(conn, table, wanted, ("dead", "pending"), "skip")
        params = {"ids": wanted, "reason": why, "skip_mark": SKIPPED_BY_OPERATOR, "table": table_regclass}
        skipped = many(conn, q(table, "skip_ids"), params, _Skipped)
        keys = sorted({str(r.ordering_key) for r in skipped if r.ordering_key is not None})
        if keys:
            # Its own statement: it sees the skip and every message of the keys committed so far.
            conn.execute(q(table, "settle_heads"), {"keys": keys})
    done = sorted(int(r.id) for r in skipped)
    logger.warning(
        "operator skipped %s message(s): %s",
        len(done),
        why,
        extra={"outcome": "skipped", "outbox_ids": done, "outbox_table": str(TableName.parse(table))},
    )
    return done
