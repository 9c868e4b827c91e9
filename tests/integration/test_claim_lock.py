"""The claim lock (DESIGN invariant 16): each claim transaction of a run takes the table's claim
lock in its first statement and counts what is in flight after it, on the run's one connection.

Claim runs race on their own connections and threads; the bound holds because every count sees
every claim committed before its lock, and a run whose transaction does not get the lock claims
nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg

from outbox_celery import OutboxConfig, Store
from outbox_celery.claim.claimer import Claimer, StoppedBy
from outbox_celery.claim.executor import Claimed
from outbox_celery.handlers import HandlerSpec

from .helpers import Connect, add, count, in_threads

TYPE = "thing.happened"
HANDLERS = {TYPE: HandlerSpec(TYPE, lambda message: None, "q")}


class _Checkouts:
    """A claimer's ``connection``: always the same connection, and how often it was asked."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.taken = 0

    @contextmanager
    def __call__(self) -> Iterator[psycopg.Connection[Any]]:
        self.taken += 1
        yield self.conn


def _publish_all(claims: Sequence[Claimed]) -> int:
    return len(claims)  # published; no task ever starts, so every claim stays in flight


def test_invariant_16_racing_claim_runs_never_put_more_than_the_bound_in_flight(
    connect: Connect, conn: psycopg.Connection[Any], table: str
) -> None:
    add(conn, 600, table=table)
    bound, claimers, runs = 40, 6, 12
    config = OutboxConfig(
        table=table, lease=60.0, batch_size=7, adaptive_in_flight=False, max_in_flight=bound
    )
    taken: list[int] = []
    guard = threading.Lock()

    def race(barrier: threading.Barrier) -> None:
        # One process each: its own connection, scan marks and store.
        claimer = Claimer(config, _Checkouts(connect()), HANDLERS, store=Store(table))
        barrier.wait(10)
        for _ in range(runs):
            run = claimer.run(_publish_all, owner="racer")
            with guard:
                taken.append(run.claimed)

    in_threads(claimers, race, timeout=60.0)
    assert sum(taken) == bound
    assert count(conn, table, "status = 'processing'") == bound


def test_a_claim_run_takes_one_connection_and_its_lock_in_its_claim_transaction(
    connect: Connect, conn: psycopg.Connection[Any], table: str
) -> None:
    [first, second] = add(conn, 2, table=table)
    store = Store(table)
    checkouts = _Checkouts(connect())
    claimer = Claimer(OutboxConfig(table=table, lease=60.0), checkouts, HANDLERS, store=store)

    holder = connect()
    with holder.transaction():
        assert store.try_claim_lock(holder)  # another run's claim transaction
        held_off = claimer.run(_publish_all)
    assert (held_off.skipped, held_off.stopped_by, held_off.claimed) == (
        True,
        StoppedBy.ANOTHER_CLAIM_RUNNING,
        0,
    )
    assert count(conn, table, "status = 'pending'") == 2

    run = claimer.run(_publish_all)
    assert (run.skipped, run.stopped_by, run.claimed) == (False, StoppedBy.DRAINED, 2)
    # No second connection held for a lock: both runs took one connection each.
    assert checkouts.taken == 2
    assert count(conn, table, f"status = 'processing' AND id IN ({first}, {second})") == 2
