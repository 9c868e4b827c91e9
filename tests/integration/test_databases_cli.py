"""One Outbox, several databases (DESIGN invariant 34): the command line and the metrics.

The commands run in this process (click's ``CliRunner``) with ``-A`` naming an Outbox declared
over databases created on the test server for the test; what they did is read back from each
database. The metrics are scraped through a ``prometheus_client`` registry.
"""

from __future__ import annotations

import json
import re
import sys
import time
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from typing import Any

import psycopg
import pytest
from celery import Celery
from click.testing import CliRunner, Result
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from outbox_celery import Database, Message, Outbox, enqueue
from outbox_celery.cli import cli
from outbox_celery.db.migrations import applied_versions, available
from outbox_celery.ops import flow_states, subscriptions
from outbox_celery.testing import temporary_database

from .test_databases import EVENT, _enqueue, _statuses
from .test_databases import three as three  # the fixture: three fresh, migrated databases

#: Every version a fresh migrate applies.
VERSIONS = [m.version for m in available()]
#: No OUTBOX_* setting of the environment running the tests reaches the commands.
CLEAN_ENV: dict[str, str | None] = {
    name: None for name in ("OUTBOX_DSN", "OUTBOX_TABLE", "OUTBOX_DATABASE", "OUTBOX_APP")
}
SECRET = "s3cret"
PAID = "order.paid"
ROUTE = f"{PAID}@receipt"

App = Callable[..., str]


@pytest.fixture
def bare(server_dsn: str) -> Iterator[dict[str, str]]:
    """Three fresh databases, a, b and c, never migrated."""
    with ExitStack() as stack:
        yield {
            name: stack.enter_context(temporary_database(server_dsn, prefix=f"outbox_cli_{name}"))
            for name in "abc"
        }


@pytest.fixture
def app(monkeypatch: pytest.MonkeyPatch) -> Iterator[App]:
    """Declare an Outbox over the databases given (or other settings: ``dsn=``), with a handler
    of ``EVENT`` and a subscription ``PAID@receipt``, in an importable module; returns the ``-A``
    spec naming it. Closed after the test."""
    made: list[Outbox] = []

    def make(databases: Any = None, **settings: Any) -> str:
        celery = Celery("databases_cli", broker="memory://", set_as_current=False)
        if databases is not None:
            settings["databases"] = databases
        outbox = Outbox(celery, retention=None, **settings)

        @outbox.handler(EVENT)
        def handle(message: Message) -> None:
            """Never run here."""

        @outbox.handler(PAID, name="receipt")
        def receipt(message: Message) -> None:
            """A subscription: migrate -A adds it to each database."""

        made.append(outbox)
        name = f"outbox_databases_cli_app_{len(made)}"
        module = types.ModuleType(name)
        module.outbox = outbox  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, name, module)
        return f"{name}:outbox"

    yield make
    for outbox in made:
        outbox.close()


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), env=CLEAN_ENV, catch_exceptions=False)


def ok(*args: str) -> str:
    """stdout of a command that must succeed."""
    result = invoke(*args)
    assert result.exit_code == 0, f"exit {result.exit_code}\n{result.output}"
    return result.stdout


def refused(*args: str) -> str:
    """The one ``Error:`` line of a refused command (exit 1, nothing on stdout)."""
    result = invoke(*args)
    assert result.exit_code == 1, f"exit {result.exit_code}\n{result.output}"
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0]


def _schema(dsn: str, table: str = "outbox") -> tuple[bool, list[int], list[str]]:
    """Whether ``table`` exists on ``dsn``, the migrations recorded for it, and its live
    subscriptions' routes."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", [table]).fetchone()
        routes = [s.route for s in subscriptions.list_subscriptions(conn, table) if s.removed_at is None]
        return bool(row and row[0]), applied_versions(conn, table), routes


NEVER = (False, [], [])  # a database never migrated
MIGRATED = (True, VERSIONS, [ROUTE])  # migrated by migrate -A (the app's subscription added)


def _set(dsn: str, assignments: str) -> None:
    """``UPDATE outbox SET <assignments>`` on ``dsn`` (written by the test), every row."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL(f"UPDATE outbox SET {assignments}"))  # type: ignore[arg-type]


# -- migrate -----------------------------------------------------------------------------------


def test_invariant_34_migrate_goes_through_every_database_of_the_app(bare: dict[str, str], app: App) -> None:
    assert [_schema(dsn) for dsn in bare.values()] == [NEVER] * 3
    spec = app(bare)
    out = ok("-A", spec, "migrate")
    last = max(VERSIONS)
    each = f"migrated outbox: applied version(s) {', '.join(map(str, VERSIONS))}; now at version {last}"
    assert out.splitlines() == [
        line for name in "abc" for line in (f"database {name}:", each, f"subscription {ROUTE} added")
    ], out
    assert [_schema(dsn) for dsn in bare.values()] == [MIGRATED] * 3
    # Idempotent, each database said so under its name.
    again = ok("-A", spec, "migrate")
    current = f"outbox is already up to date (version {last})"
    assert again.splitlines() == [
        line for name in "abc" for line in (f"database {name}:", current, f"subscription {ROUTE} exists")
    ], again
    checked = ok("-A", spec, "migrate", "--check")
    assert checked.count(f"schema of outbox is up to date (version {last})") == 3


def test_invariant_34_migrate_json_lists_every_database(bare: dict[str, str], app: App) -> None:
    spec = app(bare)
    result = json.loads(ok("-A", spec, "migrate", "--json"))
    assert list(result) == ["databases"]
    assert result["databases"] == [
        {
            "database": name,
            "table": "outbox",
            "applied_now": VERSIONS,
            "applied": VERSIONS,
            "subscriptions": [{"route": ROUTE, "state": "added"}],
        }
        for name in "abc"
    ]
    assert [_schema(dsn) for dsn in bare.values()] == [MIGRATED] * 3
    checked = json.loads(ok("-A", spec, "migrate", "--check", "--json"))
    assert [(d["database"], d["up_to_date"], d["pending"]) for d in checked["databases"]] == [
        (name, True, []) for name in "abc"
    ]


def test_invariant_34_migrate_database_touches_that_database_only(bare: dict[str, str], app: App) -> None:
    spec = app(bare)
    out = ok("-A", spec, "migrate", "--database", "b")
    assert "database " not in out  # one database: no headers
    assert out.startswith("migrated outbox: applied version(s) 1, "), out
    assert [_schema(bare[name]) for name in "abc"] == [NEVER, MIGRATED, NEVER]
    # --json with --database: that database's object, as with one dsn.
    result = json.loads(ok("-A", spec, "migrate", "--json", "--database", "c"))
    assert result == {
        "table": "outbox",
        "applied_now": VERSIONS,
        "applied": VERSIONS,
        "subscriptions": [{"route": ROUTE, "state": "added"}],
    }
    assert [_schema(bare[name]) for name in "abc"] == [NEVER, MIGRATED, MIGRATED]
    # --check of every database: exit 1, a still behind, b and c up to date.
    behind = invoke("-A", spec, "migrate", "--check")
    assert behind.exit_code == 1, behind.output
    lines = behind.stdout.splitlines()
    assert lines[0] == "database a:" and lines[1].startswith("schema of outbox is behind: pending 0001_")
    assert lines[2] == f"subscription {ROUTE} is missing (outbox-celery migrate -A adds it)"
    current = f"schema of outbox is up to date (version {max(VERSIONS)})"
    assert lines[3:] == [
        line for name in "bc" for line in (f"database {name}:", current, f"subscription {ROUTE} exists")
    ]
    assert _schema(bare["a"]) == NEVER  # --check changed nothing
    # The group's option (before the command) names it too.
    ok("--database", "a", "-A", spec, "migrate")
    assert [_schema(bare[name]) for name in "abc"] == [MIGRATED] * 3


def test_invariant_34_migrate_and_stats_use_each_databases_own_table(bare: dict[str, str], app: App) -> None:
    # A schema per tenant: two databases of the Outbox on one server database, each its table.
    dsn = bare["a"]
    spec = app([Database("t1", dsn, table="tenant_1.outbox"), Database("t2", dsn, table="tenant_2.outbox")])
    result = json.loads(ok("-A", spec, "migrate", "--json"))
    assert [(d["database"], d["table"], d["applied_now"]) for d in result["databases"]] == [
        ("t1", "tenant_1.outbox", VERSIONS),
        ("t2", "tenant_2.outbox", VERSIONS),
    ]
    assert [_schema(dsn, t) for t in ("tenant_1.outbox", "tenant_2.outbox")] == [
        (True, VERSIONS, [ROUTE])
    ] * 2
    assert _schema(dsn) == NEVER  # nothing in the Outbox's default table
    _enqueue(dsn, 2, table="tenant_2.outbox")
    pending = {
        name: json.loads(ok("-A", spec, "stats", "--json", "--database", name))["counts"]["pending"]
        for name in ("t1", "t2")
    }
    assert pending == {"t1": 0, "t2": 2}
    assert ok("-A", spec, "stats", "--database", "t2").startswith(
        "outbox database t2: table tenant_2.outbox on "
    )


# -- the commands that act on one database -----------------------------------------------------


def test_invariant_34_stats_reads_the_named_database(three: dict[str, str], app: App) -> None:
    _enqueue(three["a"], 3)
    _enqueue(three["b"], 1)
    spec = app(three)

    def counts(*where: str) -> dict[str, int]:
        return dict(json.loads(ok("-A", spec, "stats", "--json", *where))["counts"])

    assert [counts("--database", name)["pending"] for name in "abc"] == [3, 1, 0]
    assert counts("--database", "a") == {"pending": 3, "processing": 0, "done": 0, "dead": 0}
    assert json.loads(ok("--database", "b", "-A", spec, "stats", "--json"))["counts"]["pending"] == 1
    env = CliRunner().invoke(
        cli,
        ["-A", spec, "stats", "--json"],
        env={**CLEAN_ENV, "OUTBOX_DATABASE": "a"},
        catch_exceptions=False,
    )
    assert env.exit_code == 0, env.output
    assert json.loads(env.stdout)["counts"]["pending"] == 3
    text = ok("-A", spec, "stats", "--database", "b")
    first = text.splitlines()[0]
    assert first.startswith("outbox database b: table outbox on "), first
    assert conninfo_to_dict(three["b"])["dbname"] in first
    assert re.search(r"^pending\s+1\s", text, re.M), text


def test_invariant_34_dead_lists_and_requeues_in_the_named_database(three: dict[str, str], app: App) -> None:
    _enqueue(three["a"], 3)
    _enqueue(three["b"], 2)
    _set(three["b"], "status = 'dead', attempts = 5, last_error = 'boom in b'")
    spec = app(three)

    def dead(name: str) -> tuple[int, list[int]]:
        listed = json.loads(ok("-A", spec, "dead", "list", "--json", "--database", name))
        return listed["total"], [m["id"] for m in listed["messages"]]

    assert [dead(name) for name in "abc"] == [(0, []), (2, [1, 2]), (0, [])]
    assert "boom in b" in ok("-A", spec, "dead", "list", "--database", "b")
    # Id 1 is in both tables: pending in a (refused, nothing changes), dead in b.
    line = refused("-A", spec, "dead", "requeue", "1", "--database", "a")
    assert re.search(r"\b1\b.*pending", line), line
    assert _statuses(three["a"]) == {"pending": 3}
    assert _statuses(three["b"]) == {"dead": 2}
    assert json.loads(ok("-A", spec, "dead", "requeue", "1", "--json", "--database", "b")) == {
        "requeued": 1,
        "ids": [1],
    }
    assert _statuses(three["b"]) == {"dead": 1, "pending": 1}
    assert _statuses(three["a"]) == {"pending": 3}


def test_invariant_34_pause_and_resume_act_on_the_named_database(three: dict[str, str], app: App) -> None:
    spec = app(three)

    def paused() -> list[list[str]]:
        out = []
        for dsn in three.values():
            with psycopg.connect(dsn, autocommit=True) as conn:
                out.append([f.event_type for f in flow_states(conn, "outbox") if f.paused])
        return out

    assert "paused 'order.created'" in ok("-A", spec, "pause", EVENT, "--database", "b")
    assert paused() == [[], [EVENT], []]
    result = json.loads(ok("-A", spec, "pause", EVENT, "--json", "--database", "c"))
    assert (result["paused"], result["changed"]) == (True, True)
    assert paused() == [[], [EVENT], [EVENT]]
    assert "was not paused or held" in ok("-A", spec, "resume", EVENT, "--database", "a")
    assert "resumed 'order.created'" in ok("-A", spec, "resume", EVENT, "--database", "b")
    assert paused() == [[], [], [EVENT]]
    # The stats of each database say what is paused there.
    flows = {
        name: json.loads(ok("-A", spec, "stats", "--json", "--database", name))["flow"] for name in "abc"
    }
    assert [[f["event_type"] for f in flows[name]] for name in "abc"] == [[], [], [EVENT]]


def test_invariant_34_health_checks_the_named_database(
    three: dict[str, str], bare: dict[str, str], app: App
) -> None:
    # a: ready rows nobody claimed for an hour; b: nothing waits; c (of bare): never migrated.
    _enqueue(three["a"], 2)
    _set(three["a"], "available_at = now() - interval '1 hour', created_at = now() - interval '1 hour'")
    spec = app({"a": three["a"], "b": three["b"], "c": bare["c"]})
    healthy = json.loads(ok("-A", spec, "health", "--json", "--database", "b"))
    assert healthy["healthy"] is True
    assert healthy["checks"] == {"database": "ok", "schema": "ok", "claims": "ok", "broker": "ok"}
    overdue = invoke("-A", spec, "health", "--database", "a")
    assert overdue.exit_code == 1, overdue.output
    assert overdue.stdout.startswith("unhealthy: claims: "), overdue.stdout
    assert "order.created" in overdue.stdout
    never = invoke("-A", spec, "health", "--json", "--database", "c")
    assert never.exit_code == 1, never.output
    assert json.loads(never.stdout)["checks"]["schema"].startswith("table outbox was never migrated")


# -- the clear errors --------------------------------------------------------------------------

COMMANDS_OF_ONE_DATABASE: Sequence[tuple[str, ...]] = (
    ("stats",),
    ("stats", "--json"),
    ("dead", "list"),
    ("dead", "requeue", "1"),
    ("pause", EVENT),
    ("resume", EVENT),
    ("health",),
)


@pytest.mark.parametrize("command", COMMANDS_OF_ONE_DATABASE, ids=" ".join)
def test_invariant_34_a_command_of_one_database_asks_which_and_never_prints_a_dsn(
    app: App, command: tuple[str, ...]
) -> None:
    spec = app(
        {
            "eu": f"postgresql://postgres:{SECRET}@127.0.0.1:5432/x",
            "us": f"host=127.0.0.1 port=5432 dbname=y user=postgres password={SECRET}",
        }
    )
    which = refused("-A", spec, *command)
    assert which == "Error: the outbox serves several databases (eu, us): pass --database NAME"
    unknown = refused("-A", spec, *command, "--database", "nope")
    assert unknown == "Error: the outbox serves no database 'nope' (it serves: eu, us)"
    before = refused("--database", "nope", "-A", spec, *command)
    assert before == unknown
    assert SECRET not in which + unknown + before


def test_invariant_34_the_exporter_refuses_an_unknown_database_and_never_prints_a_dsn(app: App) -> None:
    """``metrics`` serves every database without ``--database`` (tests/acceptance/test_metrics.py);
    one it does not serve is refused before anything listens."""
    spec = app({"eu": f"postgresql://postgres:{SECRET}@127.0.0.1:5432/x"})
    unknown = refused("-A", spec, "metrics", "--port", "0", "--database", "nope")
    assert unknown == "Error: the outbox serves no database 'nope' (it serves: eu)"
    assert SECRET not in unknown


def test_invariant_34_migrate_of_an_unknown_database_changes_nothing(bare: dict[str, str], app: App) -> None:
    spec = app({"a": bare["a"], "b": make_conninfo(bare["b"], password=SECRET)})
    assert refused("-A", spec, "migrate", "--database", "nope") == (
        "Error: the outbox serves no database 'nope' (it serves: a, b)"
    )
    assert refused("-A", spec, "migrate", "--json", "--database", "nope").endswith("(it serves: a, b)")
    assert [_schema(bare[name]) for name in "ab"] == [NEVER] * 2


def test_invariant_34_a_database_that_cannot_be_reached_is_named_without_its_password(
    server_dsn: str, three: dict[str, str], app: App
) -> None:
    gone = make_conninfo(server_dsn, dbname="outbox_no_such_database", password=SECRET)
    url = f"postgresql://postgres:{SECRET}@127.0.0.1:1/x"  # nothing listens on port 1
    spec = app({"a": three["a"], "gone": gone, "down": url})
    for name in ("gone", "down"):
        line = refused("-A", spec, "stats", "--database", name)
        assert line.startswith("Error: cannot connect to "), line
        assert SECRET not in line
        probe = invoke("-A", spec, "health", "--database", name)
        assert probe.exit_code == 1 and probe.stdout.startswith("unhealthy: database: unreachable ")
        assert SECRET not in probe.output
    # Migrating every database stops at the first that fails, and says which it was.
    every = invoke("-A", spec, "migrate")
    assert every.exit_code == 1
    assert every.stdout.splitlines()[-1] == "database down:"  # sorted: a, down, gone
    assert SECRET not in every.output
    assert _schema(three["a"]) == (True, VERSIONS, [ROUTE])  # a was migrated: -A added the route


def test_invariant_34_database_on_an_outbox_of_one_dsn_is_refused(migrated_dsn: str, app: App) -> None:
    _enqueue(migrated_dsn, 2)
    spec = app(dsn=migrated_dsn)
    line = refused("-A", spec, "stats", "--database", "eu")
    assert line == "Error: --database eu: the outbox serves one database (its dsn), not several"
    assert json.loads(ok("-A", spec, "stats", "--json"))["counts"]["pending"] == 2


def test_invariant_34_dsn_names_the_database_itself(three: dict[str, str], app: App) -> None:
    _enqueue(three["c"], 2)
    spec = app(three)
    # --dsn beats the Outbox's databases: no --database needed, and migrate does that one only.
    assert json.loads(ok("-A", spec, "stats", "--json", "--dsn", three["c"]))["counts"]["pending"] == 2
    assert "database " not in ok("-A", spec, "migrate", "--dsn", three["c"])


def test_invariant_34_outbox_dsn_in_the_environment_does_not_replace_database(
    three: dict[str, str], app: App
) -> None:
    # A shell set up for one database (OUTBOX_DSN) operating an app that serves several: the
    # environment's DSN names none of them, --database does.
    _enqueue(three["b"], 2)
    spec = app(three)

    def run(*args: str) -> Result:
        return CliRunner().invoke(
            cli, list(args), env={**CLEAN_ENV, "OUTBOX_DSN": three["a"]}, catch_exceptions=False
        )

    stats = run("-A", spec, "stats", "--json", "--database", "b")
    assert stats.exit_code == 0, stats.output
    assert json.loads(stats.stdout)["counts"]["pending"] == 2
    unnamed = run("-A", spec, "stats")
    assert unnamed.exit_code == 1
    assert "pass --database NAME" in unnamed.stderr
    # Without an app, OUTBOX_DSN is the database, as ever.
    alone = run("stats", "--json")
    assert alone.exit_code == 0, alone.output
    assert json.loads(alone.stdout)["counts"]["pending"] == 0


# -- metrics -----------------------------------------------------------------------------------


def _scraped(outbox: Outbox) -> tuple[Any, Any, Callable[..., float | None]]:
    """The collector of ``outbox``, the registry of its own it is in, and a reader of one sample
    of a scrape (``table="outbox"`` unless given)."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from outbox_celery.ops.metrics import OutboxCollector

    registry = prometheus_client.CollectorRegistry()
    collector = OutboxCollector.from_outbox(outbox)
    registry.register(collector)

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"table": "outbox", **labels})

    return collector, registry, sample


def _outbox(name: str, databases: Any, **settings: Any) -> Outbox:
    return Outbox(Celery(name, broker="memory://", set_as_current=False), databases=databases, **settings)


def test_invariant_34_the_metrics_label_each_series_with_its_database(three: dict[str, str]) -> None:
    _enqueue(three["a"], 3)
    _enqueue(three["b"], 1)
    with psycopg.connect(three["b"], autocommit=True) as conn, conn.transaction():
        enqueue(
            conn, table="outbox", event_type="invoice.sent", aggregate_type="i", aggregate_id="1", payload={}
        )
    outbox = _outbox("databases_metrics", three, retention=None)
    outbox.handler(EVENT)(lambda message: None)
    try:
        collector, registry, sample = _scraped(outbox)
        assert [sample("outbox_messages", database=d, status="pending") for d in "abc"] == [3, 2, 0]
        assert [sample("outbox_up", database=d) for d in "abc"] == [1, 1, 1]
        assert [
            sample("outbox_event_type_messages", database=d, event_type=EVENT, status="pending") for d in "ab"
        ] == [3, 1]
        # A handler-less event type is unroutable in b only.
        assert sample("outbox_unroutable_messages", database="b", event_type="invoice.sent") == 1
        assert sample("outbox_unroutable_messages", database="a", event_type="invoice.sent") is None
        # Without the database label no series matches: every one carries it, first.
        assert sample("outbox_messages", status="pending") is None
        from prometheus_client import generate_latest

        text = generate_latest(registry).decode()
        assert text.count("# TYPE outbox_messages gauge") == 1
        assert re.search(r'^outbox_ready_messages\{database="c",table="outbox"\} 0\.0$', text, re.M), text
        families = list(collector.collect())
        assert len(families) > 20
        assert {next(iter(s.labels)) for f in families for s in f.samples} == {"database"}
        assert {s.labels["database"] for f in families for s in f.samples} == set("abc")
        # Rows added since: the next scrape reads them, in their database only.
        _enqueue(three["c"], 4)
        assert [sample("outbox_messages", database=d, status="pending") for d in "abc"] == [3, 2, 4]
    finally:
        outbox.close()


def test_invariant_34_a_database_that_fails_a_scrape_is_down_alone(three: dict[str, str]) -> None:
    _enqueue(three["a"], 2)
    with psycopg.connect(three["b"], autocommit=True) as conn:
        conn.execute("DROP TABLE outbox CASCADE")
    outbox = _outbox("databases_metrics_down", three, retention=None)
    try:
        _, _, sample = _scraped(outbox)
        assert [sample("outbox_up", database=d) for d in "abc"] == [1, 0, 1]
        assert [sample("outbox_messages", database=d, status="pending") for d in "abc"] == [2, None, 0]
    finally:
        outbox.close()


def test_invariant_34_the_metrics_follow_a_database_added_to_a_callable(three: dict[str, str]) -> None:
    _enqueue(three["b"], 2)
    declared = {"a": three["a"]}
    outbox = _outbox(
        "databases_metrics_added", lambda: dict(declared), databases_refresh=0.01, retention=None
    )
    try:
        _, _, sample = _scraped(outbox)

        def up() -> dict[str, float | None]:
            return {d: sample("outbox_up", database=d) for d in "ab"}

        assert up() == {"a": 1, "b": None}
        declared["b"] = three["b"]
        time.sleep(0.05)  # databases_refresh: the callable is read again at the next scrape
        assert up() == {"a": 1, "b": 1}
        assert sample("outbox_messages", database="b", status="pending") == 2
        # A database no longer declared is no longer scraped (rather than down for ever).
        del declared["a"]
        time.sleep(0.05)
        assert up() == {"a": None, "b": 1}
    finally:
        outbox.close()
