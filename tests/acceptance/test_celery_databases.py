"""One fleet of real workers serves several databases (DESIGN invariant 34).

A real ``celery worker`` (prefork) and ``celery beat`` run an Outbox declared with
``databases={"a": ..., "b": ...}`` on two fresh databases of the test server. Every event is
delivered once, by a handler that sees its database's name; one database is made unreachable in
the middle of the run (connections refused, its sessions ended) and comes back: the other one's
events keep flowing meanwhile, and nothing is lost or run twice on one lease.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from support.processes import CeleryProcesses, wait_until

from outbox_celery import enqueue, migrate
from outbox_celery.testing import temporary_database

pytestmark = pytest.mark.slow

EVENT = "thing.happened"


class Fleet:
    """Two outbox databases, a record database and the processes of one Outbox over them."""

    def __init__(self, dsns: dict[str, str], record: str, broker_url: str, tmp: Path) -> None:
        self.dsns = dsns
        self.record = record
        self.token = uuid.uuid4().hex[:10]
        env = {
            "OUTBOX_TEST_DATABASES": json.dumps(dsns),
            "OUTBOX_TEST_BROKER": broker_url,
            "OUTBOX_TEST_RECORD": record,
            "OUTBOX_TEST_TOKEN": self.token,
        }
        self.procs = CeleryProcesses(tmp, env, app_module="support.databases_app")
        self.queues = [f"outbox.claim.{self.token}", f"outbox.{self.token}"]

    def enqueue(self, database: str, n: int, start: int = 0) -> None:
        with psycopg.connect(self.dsns[database], autocommit=True) as conn:
            for i in range(start, start + n):
                with conn.transaction():
                    enqueue(
                        conn,
                        event_type=EVENT,
                        aggregate_type="thing",
                        aggregate_id=f"{database}-{i}",
                        payload={},
                    )

    def done(self, database: str) -> int:
        with psycopg.connect(self.dsns[database], autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM outbox WHERE status = 'done'").fetchone()
        return int(row[0]) if row else 0

    def runs(self) -> list[dict[str, Any]]:
        with psycopg.connect(self.record, autocommit=True) as conn:
            cur = conn.execute(
                "SELECT database, outbox_id, attempts, lease_version, aggregate_id, at FROM runs ORDER BY at"
            )
            cols = [c.name for c in cur.description or ()]
            return [dict(zip(cols, r, strict=True)) for r in cur.fetchall()]


@pytest.fixture
def fleet(server_dsn: str, redis_url: str, tmp_path: Path) -> Iterator[Fleet]:
    with ExitStack() as stack:
        dsns = {
            n: stack.enter_context(temporary_database(server_dsn, prefix=f"outbox_fleet_{n}")) for n in "ab"
        }
        record = stack.enter_context(temporary_database(server_dsn, prefix="outbox_fleet_runs"))
        for dsn in dsns.values():
            with psycopg.connect(dsn, autocommit=True) as conn:
                migrate(conn, "outbox")
        with psycopg.connect(record, autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE runs (database text, outbox_id bigint, attempts int, lease_version bigint,"
                " aggregate_id text, at timestamptz)"
            )
        f = Fleet(dsns, record, redis_url, tmp_path / "celery")
        try:
            yield f
        except BaseException:
            print(f.procs.logs())
            raise
        finally:
            f.procs.close()


def _block(server_dsn: str, dsn: str, allow: bool) -> None:
    """Let ``dsn``'s database take connections again, or refuse them and end its sessions."""
    name = conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(
            sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS {}").format(
                sql.Identifier(name), sql.SQL("true" if allow else "false")
            )
        )
        if not allow:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,)
            )


def test_invariant_34_one_fleet_delivers_every_database_and_one_that_goes_away_delays_only_its_own(
    fleet: Fleet, server_dsn: str
) -> None:
    worker = fleet.procs.worker(fleet.queues, concurrency=2)
    fleet.procs.beat()
    worker.wait_for_log("listening on", timeout=30, count=2)  # a listener per database
    fleet.enqueue("a", 20)
    fleet.enqueue("b", 20)
    wait_until(lambda: fleet.done("a") == 20 and fleet.done("b") == 20, 60, "the first 40 events done")

    # b goes away with 20 more events written into it; a keeps receiving events.
    fleet.enqueue("b", 20, start=20)
    _block(server_dsn, fleet.dsns["b"], allow=False)
    try:
        went = time.monotonic()
        fleet.enqueue("a", 20, start=20)
        wait_until(lambda: fleet.done("a") == 40, 30, "a's events delivered while b is away")
        a_during = time.monotonic() - went
        time.sleep(max(0.0, 4.0 - a_during))  # b stays away a few seconds
    finally:
        _block(server_dsn, fleet.dsns["b"], allow=True)
    back = time.monotonic()
    wait_until(lambda: fleet.done("b") == 40, 60, "b's events delivered after it came back")
    b_after = time.monotonic() - back
    print(f"a's 20 events during b's outage: {a_during:.1f}s; b's after it came back: {b_after:.1f}s")

    runs = fleet.runs()
    by_db = {db: {r["aggregate_id"] for r in runs if r["database"] == db} for db in "ab"}
    assert by_db == {db: {f"{db}-{i}" for i in range(40)} for db in "ab"}  # each where it was written
    leases = [(r["database"], r["outbox_id"], r["lease_version"]) for r in runs]
    assert len(leases) == len(set(leases)), "a handler ran twice on one lease"
    assert a_during < 20, f"a's events waited {a_during:.1f}s behind b's outage"
    assert b_after < 6.0 * 2, f"b's events took {b_after:.1f}s after it came back"
    # b's listener lost its session and said so; a's did not.
    lost = [line for line in worker.log().splitlines() if "reconnecting in" in line]
    assert any("outbox listener outbox:b: " in line for line in lost), lost
    assert not any("outbox listener outbox:a: " in line for line in lost), lost
