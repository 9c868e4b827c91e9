"""One Outbox, several databases (DESIGN invariant 34), on real PostgreSQL databases.

Each test creates its own databases on the test server, declares them on one Outbox by name and
drives its claims and deliveries in this process: the claim's publish is recorded instead of
sent, and each recorded task is delivered as the worker's task would deliver it
(``Outbox.deliver(id, lease_version, database)``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from celery import Celery
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from outbox_celery import ConfigurationError, Database, Message, Outbox, UnknownDatabase, enqueue, migrate
from outbox_celery.claim.claimer import Published
from outbox_celery.claim.executor import Claimed
from outbox_celery.testing import temporary_database

EVENT = "order.created"


@pytest.fixture
def three(server_dsn: str) -> Iterator[dict[str, str]]:
    """Three fresh, migrated databases: a, b and c."""
    with ExitStack() as stack:
        dsns = {
            name: stack.enter_context(temporary_database(server_dsn, prefix=f"outbox_db_{name}"))
            for name in "abc"
        }
        for dsn in dsns.values():
            with psycopg.connect(dsn, autocommit=True) as conn:
                migrate(conn, "outbox")
        yield dsns


class Recorded:
    """An Outbox of several databases whose publishes are recorded, and its handler's calls."""

    def __init__(self, databases: Any, **settings: Any) -> None:
        app = Celery("databases", set_as_current=False)
        settings.setdefault("retention", None)
        self.outbox = Outbox(app, databases=databases, **settings)
        self.tasks: list[tuple[str, Claimed]] = []
        self.calls: list[Message] = []

        @self.outbox.handler(EVENT)
        def handle(message: Message) -> None:
            self.calls.append(message)

        def publish(claims: Sequence[Claimed], database: str | None = None) -> Published:
            assert database is not None
            self.tasks += [(database, c) for c in claims]
            return Published(list(claims), {})

        self.outbox.publish = publish  # type: ignore[method-assign]

    def deliver_all(self) -> dict[str, list[str]]:
        """Deliver every recorded task; the outcomes by database."""
        outcomes: dict[str, list[str]] = {}
        tasks, self.tasks = self.tasks, []
        for database, c in tasks:
            outcomes.setdefault(database, []).append(self.outbox.deliver(c.id, c.lease_version, database))
        self.outbox.close()
        return outcomes


def _enqueue(dsn: str, n: int, table: str = "outbox") -> None:
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        for i in range(n):
            enqueue(
                conn,
                table=table,
                event_type=EVENT,
                aggregate_type="order",
                aggregate_id=str(i),
                payload={"i": i},
            )


def _statuses(dsn: str, table: str = "outbox") -> dict[str, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            sql.SQL("SELECT status, count(*) FROM {} GROUP BY status").format(
                sql.Identifier(*table.split("."))
            )
        ).fetchall()
    return {str(s): int(n) for s, n in rows}


def _outbox_sessions(dsn: str) -> int:
    """Sessions of the library's pools connected to ``dsn``'s database."""
    name = conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = %s AND application_name LIKE 'outbox-celery:%%'",
            (name,),
        ).fetchone()
    return int(row[0]) if row else 0


def test_invariant_34_one_claim_serves_every_database_and_each_task_names_its_database(
    three: dict[str, str],
) -> None:
    for n, dsn in zip((3, 2, 1), three.values(), strict=True):
        _enqueue(dsn, n)
    r = Recorded(three)
    run = r.outbox.claim()
    assert run.claimed == 6
    assert sorted(d for d, _ in r.tasks) == ["a", "a", "a", "b", "b", "c"]
    assert r.deliver_all() == {"a": ["done"] * 3, "b": ["done"] * 2, "c": ["done"]}
    assert sorted(m.database or "" for m in r.calls) == ["a", "a", "a", "b", "b", "c"]
    for dsn, n in zip(three.values(), (3, 2, 1), strict=True):
        assert _statuses(dsn) == {"done": n}


def test_invariant_34_task_ids_and_flower_names_carry_the_database(three: dict[str, str]) -> None:
    r = Recorded(three)
    claim = Claimed(id=7, lease_version=3, event_type=EVENT, lease_until=datetime.now(UTC))
    assert r.outbox.task_id(claim, "b") == "b/outbox:7:v3"
    assert r.outbox.task_id(claim) == "outbox:7:v3"


def test_invariant_34_a_task_naming_an_unknown_database_is_refused_and_its_row_comes_back_unspent(
    three: dict[str, str],
) -> None:
    _enqueue(three["a"], 1)
    r = Recorded(three, lease=2.0, claim_interval=0.5)
    r.outbox.claim()
    [(_, c)] = r.tasks
    with pytest.raises(UnknownDatabase, match="no database named 'nope'"):
        r.outbox.deliver(c.id, c.lease_version, "nope")
    with pytest.raises(UnknownDatabase, match="names none"):
        r.outbox.deliver(c.id, c.lease_version)
    with psycopg.connect(three["a"], autocommit=True) as conn:
        attempts = conn.execute("SELECT attempts FROM outbox WHERE id = %s", (c.id,)).fetchone()
    assert attempts == (0,)  # never started: nothing spent
    time.sleep(2.2)  # its lease ends
    r.tasks.clear()
    # Given back with no attempt spent and, a first lost claim, claimed again in the same run
    # (invariant 16): a new task under a new token.
    r.outbox.claim()
    assert [(d, t.id, t.lease_version) for d, t in r.tasks] == [("a", c.id, c.lease_version + 1)]
    with psycopg.connect(three["a"], autocommit=True) as conn:
        assert conn.execute("SELECT status, attempts FROM outbox").fetchone() == ("processing", 0)
    assert r.deliver_all() == {"a": ["done"]}
    assert [m.attempts for m in r.calls] == [1]


def test_invariant_34_a_busy_database_never_keeps_a_quiet_one_from_its_turn(three: dict[str, str]) -> None:
    _enqueue(three["a"], 3000)
    _enqueue(three["c"], 5)
    # Each run claims batches while they come back full, for claim_budget at most: a's backlog
    # outlasts any run, yet c's rows go out in the first one whatever the turn's order.
    r = Recorded(three, batch_size=20, claim_budget=0.05, max_in_flight=5000)
    r.outbox.claim()
    by_db = {d: sum(1 for x, _ in r.tasks if x == d) for d in "abc"}
    assert by_db["c"] == 5
    assert 0 < by_db["a"] < 3000


def test_invariant_34_a_database_that_is_down_delays_only_its_own_rows(
    three: dict[str, str], server_dsn: str
) -> None:
    for dsn in three.values():
        _enqueue(dsn, 2)
    b = conninfo_to_dict(three["b"])["dbname"]
    r = Recorded(three)
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS false").format(sql.Identifier(b)))
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (b,))
        try:
            run = r.outbox.claim()
            assert run.claimed == 4
            assert any(e.startswith("b: ") for e in run.errors), run.errors
            assert r.deliver_all() == {"a": ["done"] * 2, "c": ["done"] * 2}
        finally:
            admin.execute(sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS true").format(sql.Identifier(b)))
    # b is tried again after its backoff (0.5 s after one failure) and its rows go out.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not r.tasks:
        r.outbox.claim()
        time.sleep(0.1)
    assert sorted(d for d, _ in r.tasks) == ["b", "b"]
    assert r.deliver_all() == {"b": ["done"] * 2}
    assert _statuses(three["b"]) == {"done": 2}


def test_invariant_34_an_idle_database_is_claimed_once_per_idle_sweep(three: dict[str, str]) -> None:
    # A sweep long enough for ten claim runs on a loaded machine to fit in it.
    r = Recorded(three, idle_sweep=3.0, claim_interval=0.2)
    lanes = r.outbox.lanes
    assert lanes is not None
    runs: list[str] = []
    claim_one = lanes.claim_one

    def counted(lane: Any, publish: Any, *, owner: str) -> Any:
        runs.append(lane.name)
        return claim_one(lane, publish, owner=owner)

    lanes.claim_one = counted  # type: ignore[method-assign]
    probes: list[str] = []
    for lane in lanes.lanes():
        probe = lane.probe

        def probed(probe: Any = probe, name: str = lane.name) -> bool:
            probes.append(name)
            return bool(probe())

        lane.probe = probed  # type: ignore[method-assign]
    before = time.monotonic()
    for _ in range(10):
        r.outbox.claim()
    # A database this process has not claimed yet is swept first (DESIGN invariant 36): each is
    # asked once, none has work, none is claimed, and none is asked again until its sweep.
    assert sorted(probes) == ["a", "b", "c"]
    assert runs == []
    # Each database's next sweep comes at its own moment, from half a sweep to a sweep and a
    # half after the last (DESIGN invariant 35): after that long, every one is due.
    now = time.monotonic()
    assert all(lane.quiet_until - before >= 1.5 and lane.quiet_until - now <= 4.5 for lane in lanes.lanes())
    _enqueue(three["b"], 1)
    time.sleep(4.55)
    runs.clear()
    probes.clear()
    r.outbox.close()  # the sweep finds every pool closed, as an idle database's is
    r.outbox.claim()
    # Each sweep asks its one question; only b, which has a row now, is claimed.
    assert sorted(probes) == ["a", "b", "c"]
    assert runs == ["b"]
    assert [d for d, _ in r.tasks] == ["b"]
    # The quiet ones' questions left no connection open behind them.
    assert [_outbox_sessions(three[d]) for d in "ac"] == [0, 0]
    # b did something: it is claimed at every run, without asking, until idle a whole sweep.
    runs.clear()
    probes.clear()
    r.outbox.claim()
    r.outbox.claim()
    assert runs == ["b", "b"] and probes == []
    r.outbox.close()


def test_invariant_36_an_idle_sweep_finds_a_lease_that_ran_out_and_claims_it(three: dict[str, str]) -> None:
    # No notification announces a lease that ran out: the idle sweep's question must find it.
    r = Recorded(three, idle_sweep=0.5, claim_interval=0.1, lease=2.0)
    _enqueue(three["a"], 1)
    r.outbox.claim()
    assert [d for d, _ in r.tasks] == ["a"]  # claimed; its task is lost (never delivered)
    r.tasks.clear()
    lanes = r.outbox.lanes
    assert lanes is not None
    lane = lanes.get("a")
    answers: list[bool] = []
    probe = lane.probe

    def probed() -> bool:
        answers.append(probe())
        return answers[-1]

    lane.probe = probed  # type: ignore[method-assign]
    # Back to pending once it ran out (a first lost task waits its lease only), then claimed.
    deadline = time.monotonic() + 20.0
    while not r.tasks:
        assert time.monotonic() < deadline, "the lost task's row never came back"
        r.outbox.claim()
        time.sleep(0.05)
    assert [d for d, _ in r.tasks] == ["a"]
    # Idle sweeps asked while the lease was live (no), then found it run out (yes).
    assert False in answers and answers[-1] is True, answers
    assert r.deliver_all() == {"a": ["done"]}


def test_invariant_34_a_process_connects_only_to_the_databases_it_delivers_for_and_closes_idle_ones(
    three: dict[str, str],
) -> None:
    _enqueue(three["a"], 2)
    r = Recorded(three, database_idle_close=1.0)
    r.outbox.claim()
    r.outbox.close()  # the claim's pools closed: what follows is the deliveries'
    for database, c in r.tasks:
        assert r.outbox.deliver(c.id, c.lease_version, database) == "done"
    assert [_outbox_sessions(three[d]) for d in "abc"] == [1, 0, 0]  # a delivery at a time: one
    lanes = r.outbox.lanes
    assert lanes is not None
    time.sleep(1.1)
    lanes._idle_checked = 0.0  # the next look is not held back by the last second's
    assert lanes.close_idle() == ["a"]
    assert [_outbox_sessions(three[d]) for d in "abc"] == [0, 0, 0]
    r.outbox.close()


def test_invariant_34_a_database_added_to_a_callable_is_served_without_a_restart(
    three: dict[str, str],
) -> None:
    declared = {"a": three["a"]}
    r = Recorded(lambda: dict(declared), databases_refresh=60.0)
    _enqueue(three["b"], 1)
    r.outbox.claim()
    assert r.tasks == []
    assert sorted(r.outbox.databases) == ["a"]
    declared["b"] = three["b"]
    # A task naming a database the process does not know makes it read the callable again.
    assert r.outbox.database("b").name == "b"
    r.outbox.claim()
    assert [d for d, _ in r.tasks] == ["b"]
    assert r.deliver_all() == {"b": ["done"]}


def test_invariant_34_a_schema_per_tenant_is_a_database_with_its_own_table(three: dict[str, str]) -> None:
    dsn = three["a"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        for tenant in ("tenant_1", "tenant_2"):
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(tenant)))
            migrate(conn, f"{tenant}.outbox")
    _enqueue(dsn, 2, table="tenant_1.outbox")
    _enqueue(dsn, 1, table="tenant_2.outbox")
    r = Recorded([Database("t1", dsn, table="tenant_1.outbox"), Database("t2", dsn, table="tenant_2.outbox")])
    event = {"event_type": EVENT, "aggregate_type": "o", "aggregate_id": "1", "payload": {}}
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        # The Outbox's own table ("outbox", which this database has) is no tenant's: a row
        # there would be claimed by nobody. Without database= the write is refused.
        with pytest.raises(
            ConfigurationError, match=r"t1, t2 have tables of their own.*name one with database="
        ):
            r.outbox.enqueue(conn, **event)
        with pytest.raises(ConfigurationError, match="name one with database="):
            r.outbox.enqueue_many(conn, [event])
        r.outbox.enqueue(conn, database="t2", **event)
    assert _statuses(dsn) == {}
    r.outbox.claim()
    assert r.deliver_all() == {"t1": ["done"] * 2, "t2": ["done"] * 2}
    assert _statuses(dsn, "tenant_1.outbox") == {"done": 2}
    assert _statuses(dsn, "tenant_2.outbox") == {"done": 2}


def test_invariant_34_pause_and_enqueue_name_the_database(three: dict[str, str]) -> None:
    # listen off: no push listener claims on the resume's notification, so every beat-triggered
    # run claims every database (no idle sweep).
    r = Recorded(three, listen=False)
    with psycopg.connect(three["b"], autocommit=True) as conn, conn.transaction():
        r.outbox.enqueue(
            conn, database="b", event_type=EVENT, aggregate_type="o", aggregate_id="1", payload={}
        )
    _enqueue(three["a"], 1)
    assert r.outbox.pause(EVENT, database="b") is True
    r.outbox.claim()
    assert [d for d, _ in r.tasks] == ["a"]
    r.tasks.clear()
    assert r.outbox.resume(EVENT) is True  # every database
    r.outbox.claim()
    assert [d for d, _ in r.tasks] == ["b"]
    r.outbox.close()


@pytest.mark.parametrize(
    ("databases", "message"),
    [
        ({"e u": "dbname=x"}, "invalid database name 'e u'"),
        ({"eu": 5}, "give a DSN string or a Database"),
        ([Database("eu", "dbname=x"), Database("eu", "dbname=y")], "declared twice"),
        ({"eu": "host='unclosed password=secret"}, "its dsn does not parse"),
        ([Database("eu", "dbname=x", table="a.b.c")], "invalid table name"),
    ],
)
def test_invariant_34_bad_declarations_are_refused_at_once_without_quoting_a_dsn(
    databases: Any, message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message) as err:
        Outbox(Celery("bad", set_as_current=False), databases=databases).config  # noqa: B018
    assert "secret" not in str(err.value)


def test_invariant_34_dsn_and_databases_are_not_both_given() -> None:
    from outbox_celery import ConfigurationError

    with pytest.raises(ConfigurationError, match="not both"):
        Outbox(Celery("bad", set_as_current=False), dsn="dbname=x", databases={"a": "dbname=y"}).config  # noqa: B018
