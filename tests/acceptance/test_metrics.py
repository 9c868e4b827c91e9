"""Prometheus metrics: the exporter scraped over HTTP, and the collector in a user's registry."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from celery import Celery
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from outbox_celery import Event, TableName, enqueue_many, migrate
from outbox_celery.app.outbox import Outbox
from outbox_celery.ops.metrics import OutboxCollector
from outbox_celery.testing import free_port, temporary_database

SETTLE = 60.0  # seconds; bounds waiting for the exporter, never asserts speed
#: The exporter with the library's log records on stderr.
EXPORTER = [sys.executable, "-m", "outbox_celery", "--verbose", "metrics"]

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _env(dsn: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_") or k.startswith("OUTBOX_TEST_")}
    if dsn is not None:
        env["OUTBOX_DSN"] = dsn
    return env


def add(
    conn: psycopg.Connection[Any], n: int, *, table: str, event_type: str, key: str | None = None
) -> list[int]:
    events = [Event(event_type, {"n": i}, "order", str(i), ordering_key=key) for i in range(n)]
    with conn.transaction():
        return enqueue_many(conn, events, table=table)


def update(conn: psycopg.Connection[Any], table: str, ids: list[int], assignments: str) -> None:
    """``UPDATE ... SET <assignments>`` for ``ids`` (assignments are written by the test)."""
    query = sql.SQL("UPDATE {} SET " + assignments + " WHERE id = ANY(%s)")
    conn.execute(query.format(TableName.parse(table).identifier()), [ids])


def counts(conn: psycopg.Connection[Any], table: str) -> dict[str, int]:
    query = sql.SQL("SELECT status, count(*) FROM {} GROUP BY status").format(
        TableName.parse(table).identifier()
    )
    found = dict(conn.execute(query).fetchall())
    return {s: int(found.get(s, 0)) for s in ("pending", "processing", "done", "dead")}


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in samples, f"no sample {name}{labels}; have {sorted(k[0] for k in samples)}"
    return samples[key]


@pytest.fixture
def exporter(migrated_dsn: str, tmp_path: Path) -> Iterator[tuple[int, subprocess.Popen[bytes], Path]]:
    """``python -m outbox_celery metrics`` on a free port, in its own process group."""
    port = free_port()
    log = tmp_path / "exporter.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "outbox_celery", "metrics", "--port", str(port), "--addr", "127.0.0.1"],
            env=_env(migrated_dsn),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield port, proc, log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def scrape(port: int, proc: subprocess.Popen[bytes], log: Path) -> str:
    """GET /metrics, waiting for the exporter to listen (bounded)."""
    deadline = time.monotonic() + SETTLE
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
                assert response.status == 200
                return str(response.read().decode("utf-8"))
        except (urllib.error.URLError, ConnectionError):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"exporter not serving (exit {proc.poll()}):\n{log.read_text()}"
                ) from None
            time.sleep(0.1)


def test_exporter_metrics_page_matches_the_table(
    exporter: tuple[int, subprocess.Popen[bytes], Path], conn: psycopg.Connection[Any], table: str
) -> None:
    port, proc, log = exporter
    orders = add(conn, 5, table=table, event_type="order.created")
    update(
        conn,
        table,
        orders[:1],
        "created_at = now() - interval '2 hours', available_at = now() - interval '1 hour'",
    )
    mails = add(conn, 4, table=table, event_type="mail.sent")
    update(conn, table, mails[:2], "status = 'done', done_at = now()")
    update(conn, table, mails[2:3], "status = 'dead', attempts = 3, last_error = 'x'")
    update(
        conn,
        table,
        mails[3:],
        "status = 'processing', attempts = 1, lease_until = now() - interval '5 seconds'",
    )
    keyed = add(conn, 3, table=table, event_type="invoice.sent", key="k")
    update(conn, table, keyed[:1], "status = 'dead', attempts = 2")

    samples = parse(scrape(port, proc, log))
    truth = counts(conn, table)
    assert truth == {"pending": 7, "processing": 1, "done": 2, "dead": 2}
    assert value(samples, "outbox_up", table=table) == 1
    for status, n in truth.items():
        assert value(samples, "outbox_messages", table=table, status=status) == n
    assert value(samples, "outbox_ready_messages", table=table) == 5
    assert 7200 <= value(samples, "outbox_oldest_pending_age_seconds", table=table) < 7300
    assert 3600 <= value(samples, "outbox_oldest_ready_wait_seconds", table=table) < 3700
    assert value(samples, "outbox_expired_leases", table=table) == 1
    assert value(samples, "outbox_blocked_keys", table=table) == 1
    assert value(samples, "outbox_blocked_messages", table=table) == 2
    assert (
        value(samples, "outbox_event_type_messages", table=table, event_type="mail.sent", status="dead") == 1
    )
    assert (
        value(samples, "outbox_event_type_messages", table=table, event_type="invoice.sent", status="pending")
        == 2
    )
    assert value(samples, "outbox_attempts_messages", table=table, attempts="3", status="dead") == 1
    # Without handlers the exporter cannot tell what is unroutable: no such series.
    assert not [k for k in samples if k[0] == "outbox_unroutable_messages"]

    # The next scrape follows the table.
    update(conn, table, orders[1:3], "status = 'dead'")
    update(conn, table, mails[3:], "lease_until = now() + interval '1 minute'")
    samples = parse(scrape(port, proc, log))
    assert value(samples, "outbox_messages", table=table, status="dead") == counts(conn, table)["dead"] == 4
    assert value(samples, "outbox_messages", table=table, status="pending") == 5
    assert value(samples, "outbox_expired_leases", table=table) == 0

    # SIGTERM stops it cleanly.
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=SETTLE) == 0
    assert "serving metrics of table" in log.read_text()
    assert "password" not in log.read_text() or "password=***" in log.read_text()


def test_invariant_34_the_exporter_serves_every_database_of_an_outbox_and_holds_no_connection(
    server_dsn: str, tmp_path: Path
) -> None:
    """``metrics -A`` of an Outbox over several databases, without ``--database``: every database,
    labelled; one that refuses connections is down alone, its DSN's password never printed; and
    between scrapes the exporter holds no connection (one of its own per database and scrape)."""
    secret = "s3cret-of-c"
    with ExitStack() as stack:
        dsns = {d: stack.enter_context(temporary_database(server_dsn, prefix=f"outbox_m_{d}")) for d in "ab"}
        for d, n in (("a", 3), ("b", 1)):
            with psycopg.connect(dsns[d], autocommit=True) as conn:
                migrate(conn, "outbox")
                add(conn, n, table="outbox", event_type="thing.happened")
        dsns["c"] = f"postgresql://postgres:{secret}@127.0.0.1:1/gone"  # nothing listens on port 1
        env = {
            **_env(None),
            "OUTBOX_TEST_DATABASES": json.dumps(dsns),
            "OUTBOX_TEST_BROKER": "memory://",
            "OUTBOX_TEST_RECORD": server_dsn,
            "OUTBOX_TEST_TOKEN": "metrics",
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
        }
        port, log = free_port(), tmp_path / "exporter.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [*EXPORTER, "-A", "support.databases_app:outbox", "--port", str(port)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            samples = parse(scrape(port, proc, log))
            pending = {
                d: value(samples, "outbox_messages", database=d, table="outbox", status="pending")
                for d in "ab"
            }
            assert pending == {"a": 3, "b": 1}
            assert {d: value(samples, "outbox_up", database=d, table="outbox") for d in "abc"} == {
                "a": 1,
                "b": 1,
                "c": 0,
            }
            # Read after the page was served: every connection of the scrape was closed by then
            # (a backend may take a moment to end after its client said goodbye).
            deadline = time.monotonic() + SETTLE
            with psycopg.connect(server_dsn, autocommit=True) as admin:
                while True:
                    held = admin.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'outbox-celery%%'"
                        " AND datname = ANY(%s)",
                        [[conninfo_to_dict(dsns[d])["dbname"] for d in "ab"]],
                    ).fetchone()
                    if held == (0,) or time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
            assert held == (0,), "the exporter holds connections between scrapes"
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    text = log.read_text()
    assert "serving metrics of the databases of outbox outbox (a, b, c)" in text, text
    assert "in database c failed" in text, text
    assert secret not in text


def test_exporter_refuses_a_busy_port_with_one_line(migrated_dsn: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "outbox_celery", "metrics", "--port", str(port), "--addr", "127.0.0.1"],
            env=_env(migrated_dsn),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"Error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]


def test_collector_in_a_users_registry_reports_several_tables(
    migrated_dsn: str, conn: psycopg.Connection[Any], table: str
) -> None:
    migrate(conn, "billing.outbox")
    add(conn, 2, table=table, event_type="order.created")
    dead = add(conn, 3, table="billing.outbox", event_type="invoice.sent")
    update(conn, "billing.outbox", dead, "status = 'dead'")

    registry = CollectorRegistry()
    registry.register(OutboxCollector(migrated_dsn, [table, "billing.outbox"]))
    assert registry.get_sample_value("outbox_messages", {"table": table, "status": "pending"}) == 2
    assert registry.get_sample_value("outbox_messages", {"table": table, "status": "dead"}) == 0
    assert registry.get_sample_value("outbox_messages", {"table": "billing.outbox", "status": "dead"}) == 3
    assert registry.get_sample_value("outbox_up", {"table": "billing.outbox"}) == 1
    # Exposition works and every family appears once.
    text = generate_latest(registry).decode()
    assert text.count("# TYPE outbox_messages gauge") == 1


def test_collector_reports_down_instead_of_failing_the_scrape() -> None:
    registry = CollectorRegistry()
    # Registering never touches the database.
    registry.register(OutboxCollector("postgresql://nobody:pw@127.0.0.1:1/none", "outbox", connect_timeout=1))
    samples = parse(generate_latest(registry).decode())
    assert value(samples, "outbox_up", table="outbox") == 0
    assert not [k for k in samples if k[0] == "outbox_messages"]


def test_collector_from_an_outbox_knows_its_handlers(
    migrated_dsn: str, conn: psycopg.Connection[Any], table: str
) -> None:
    add(conn, 2, table=table, event_type="order.created")
    add(conn, 3, table=table, event_type="invoice.sent")
    app = Celery("metrics-test", broker="memory://", set_as_current=False)
    outbox = Outbox(app, dsn=migrated_dsn, table=table)
    outbox.handler("order.created")(lambda message: None)
    try:
        registry = CollectorRegistry()
        registry.register(OutboxCollector.from_outbox(outbox, namespace="shop_outbox"))
        assert (
            registry.get_sample_value(
                "shop_outbox_unroutable_messages", {"table": table, "event_type": "invoice.sent"}
            )
            == 3
        )
        assert (
            registry.get_sample_value(
                "shop_outbox_unroutable_messages", {"table": table, "event_type": "order.created"}
            )
            is None
        )
        assert registry.get_sample_value("shop_outbox_messages", {"table": table, "status": "pending"}) == 5
    finally:
        outbox.close()


def test_collector_reports_messages_whose_tasks_never_started_per_event_type(
    migrated_dsn: str, conn: psycopg.Connection[Any], table: str
) -> None:
    # Invariants 10, 16: claims nobody starts (a queue with no consumer) are visible as a gauge.
    lost = add(conn, 2, table=table, event_type="order.created")
    update(conn, table, lost, "lease_version = 3")
    add(conn, 1, table=table, event_type="invoice.sent")
    registry = CollectorRegistry()
    registry.register(OutboxCollector(migrated_dsn, table))
    got = registry.get_sample_value
    assert got("outbox_unstarted_messages", {"table": table, "event_type": "order.created"}) == 2
    assert got("outbox_unstarted_messages", {"table": table, "event_type": "invoice.sent"}) == 0


def test_the_documented_metrics_and_alert_rules_match_the_collector() -> None:
    """docs/operations.md lists every metric, and its alert rules only use metrics that exist."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    collector = OutboxCollector("postgresql://nobody@127.0.0.1:1/none", "outbox", handlers=set())
    gauges = {family.name for family in collector.describe()}
    known = gauges | {"outbox_deliveries_total"}  # the optional worker-side counter

    gauges_section = doc.split("### Gauges", 1)[1].split("\n#", 1)[0]
    documented = set(re.findall(r"^\| `(outbox_[a-z_]+)` \|", gauges_section, re.M))
    assert documented == gauges

    blocks = re.findall(r"```yaml\n(.*?)```", doc, re.S)
    # The alert rules' blocks (the page's other YAML blocks are probes and compose files).
    loaded = [yaml.safe_load(block) for block in blocks if block.lstrip().startswith("groups:")]
    # The shipped rules the page points to (monitoring/, checked in depth by tests/unit/test_monitoring.py).
    loaded.append(
        yaml.safe_load((Path(__file__).resolve().parents[2] / "monitoring" / "outbox-alerts.yml").read_text())
    )
    rules = [
        rule
        for d in loaded
        if isinstance(d, dict) and "groups" in d
        for g in d["groups"]
        for rule in g["rules"]
    ]
    assert len(rules) >= 5
    for rule in rules:
        used = set(re.findall(r"\boutbox_[a-z_]+", rule["expr"]))
        assert used, rule
        assert used <= known, f"{rule['alert']} uses unknown metric(s) {used - known}"


def test_collector_reports_what_holds_the_xmin_horizon(
    migrated_dsn: str, conn: psycopg.Connection[Any], table: str
) -> None:
    # Invariant 18: a scrape says who pins the horizon and how many dead versions the table has.
    registry = CollectorRegistry()
    registry.register(OutboxCollector(migrated_dsn, table))
    got = registry.get_sample_value
    with psycopg.connect(migrated_dsn, application_name="nightly-report") as held:
        held.execute("SELECT pg_current_xact_id()")
        time.sleep(1.1)
        assert (got("outbox_xmin_horizon_age_seconds", {"table": table, "kind": "transaction"}) or 0) >= 1
        assert (got("outbox_xmin_horizon_age_xids", {"table": table, "kind": "transaction"}) or 0) >= 1
        assert got("outbox_dead_row_versions", {"table": table}) is not None
    assert got("outbox_xmin_horizon_age_seconds", {"table": table, "kind": "transaction"}) is None


def test_invariant_9_the_collector_reports_ordered_keys_without_a_head(
    migrated_dsn: str, conn: psycopg.Connection[Any], table: str
) -> None:
    # A key left without a head (an old release's producer or worker after
    # migration 0004) is never claimed; the gauge makes it visible and alertable.
    keyed = add(conn, 3, table=table, event_type="invoice.sent", key="k")
    add(conn, 1, table=table, event_type="invoice.sent", key="fine")
    update(conn, table, keyed, "head = false")
    registry = CollectorRegistry()
    registry.register(OutboxCollector(migrated_dsn, table))
    assert registry.get_sample_value("outbox_headless_keys", {"table": table}) == 1
    assert registry.get_sample_value("outbox_blocked_keys", {"table": table}) == 0


def _listening(port: int) -> set[str]:
    """Local addresses with a TCP socket listening on ``port`` (Linux /proc/net/tcp, IPv4)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, _, state = line.split()[1], line.split()[2], line.split()[3]
        host, _, hex_port = local.partition(":")
        if state == "0A" and int(hex_port, 16) == port:
            found.add(socket.inet_ntoa(bytes.fromhex(host)[::-1]))
    return found


def test_the_exporter_listens_on_the_loopback_interface_unless_told_otherwise(
    migrated_dsn: str, tmp_path: Path
) -> None:
    # It bound 0.0.0.0 by default, with no authentication: event types and depths
    # readable from any host that reaches this one.
    if not Path("/proc/net/tcp").exists():
        pytest.skip("reads /proc/net/tcp (Linux)")
    port = free_port()
    log = tmp_path / "exporter.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "outbox_celery", "metrics", "--port", str(port)],
            env=_env(migrated_dsn),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        assert "outbox_up" in scrape(port, proc, log)
        assert _listening(port) == {"127.0.0.1"}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=SETTLE)
