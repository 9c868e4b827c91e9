"""The adaptive in-flight bound (DESIGN invariants 16 and 37), read from rows finished at known
times: alone, what the workers finished in the last lease, halved; one of several databases
whose claims are pushed, what they finished in the last ``SHARED_MEASURE`` seconds, scaled to
``SHARED_AHEAD``; clamped to ``[min_in_flight, max_in_flight]``.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg import sql

from outbox_celery import OutboxConfig, Store
from outbox_celery.claim.claimer import SHARED_AHEAD, SHARED_MEASURE, InFlightBound
from outbox_celery.table import TableName

from .helpers import add


def _finished(conn: psycopg.Connection[Any], table: str, n: int, seconds_ago: float) -> None:
    ids = add(conn, n, table=table)
    conn.execute(
        sql.SQL(
            "UPDATE {} SET status = 'done', done_at = now() - make_interval(secs => %s) WHERE id = ANY(%s)"
        ).format(TableName.parse(table).identifier()),
        (seconds_ago, ids),
    )


@pytest.mark.parametrize(
    ("shared", "listen", "expected"),
    [
        # Alone: 300 + 400 finished in the last lease (60 s), halved.
        (False, True, 350),
        # Several databases, pushed: the 300 of the last SHARED_MEASURE seconds, scaled.
        (True, True, int(300 * SHARED_AHEAD / SHARED_MEASURE)),
        # Several, claimed by beat alone: a claim comes only every claim_interval, as alone.
        (True, False, 350),
    ],
)
def test_invariant_37_the_bound_of_a_database_sharing_the_queue_with_others_is_seconds_of_its_throughput(
    conn: psycopg.Connection[Any], store: Store, table: str, shared: bool, listen: bool, expected: int
) -> None:
    _finished(conn, table, 300, SHARED_MEASURE / 2)
    _finished(conn, table, 400, SHARED_MEASURE * 3)
    _finished(conn, table, 500, 120.0)  # past the lease: counts nowhere
    config = OutboxConfig(table=table, lease=60.0, listen=listen, min_in_flight=1, max_in_flight=1000)
    assert InFlightBound(config, store, shared=shared)(conn) == expected


def test_invariant_37_the_bound_stays_within_its_floor_and_ceiling(
    conn: psycopg.Connection[Any], store: Store, table: str
) -> None:
    _finished(conn, table, 50, 1.0)
    low = OutboxConfig(table=table, lease=60.0, min_in_flight=40, max_in_flight=1000)
    assert InFlightBound(low, store, shared=True)(conn) == 40  # 10 from throughput: the floor
    high = OutboxConfig(table=table, lease=60.0, min_in_flight=1, max_in_flight=5)
    assert InFlightBound(high, store, shared=True)(conn) == 5
