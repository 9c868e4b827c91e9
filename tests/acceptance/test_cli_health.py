"""``outbox-celery health``: exit 0, or 1 with the reason on one line (``--json`` too), for probes.

Each failure is made to happen: the database stops (the TCP path to it closes), a migration is
missing, claims stop (ready messages overdue). The horizon is a warning, never a failure.
"""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from support.tcp_proxy import FreezableProxy

from outbox_celery import ops
from outbox_celery.db.migrations import available
from outbox_celery.ops import health
from outbox_celery.testing import free_port

from .test_cli import add, ok, one_line_error, run, update
from .test_cli_subscriptions import APP, cli


def unhealthy(result: Any) -> str:
    """The one line of a failed check: exit 1, nothing on stderr."""
    assert result.returncode == 1, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and result.stderr == "", (result.stdout, result.stderr)
    assert lines[0].startswith("unhealthy: ")
    return lines[0]


def test_health_is_ok_on_a_current_schema_with_claims_on_time(
    migrated_dsn: str, conn: Any, table: str
) -> None:
    add(conn, 3, table=table)  # ready now: not overdue
    assert ok(run("health", dsn=migrated_dsn)).strip() == "ok: database ok, schema ok, claims ok"
    doc = json.loads(ok(run("health", "--json", dsn=migrated_dsn)))
    assert doc["healthy"] is True and doc["reason"] is None
    assert doc["checks"] == {"database": "ok", "schema": "ok", "claims": "ok"}
    assert doc["schema_version"] == max(m.version for m in available())


def test_health_fails_when_the_database_stops(migrated_dsn: str) -> None:
    params = conninfo_to_dict(migrated_dsn)
    proxy = FreezableProxy((str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432)))
    through = make_conninfo(migrated_dsn, host="127.0.0.1", port=proxy.port, password="s3cret-pw")
    try:
        assert ok(run("health", dsn=through)).startswith("ok:")
    finally:
        proxy.close()  # the database is gone: connections refused
    line = unhealthy(run("health", "--timeout", "2s", dsn=through))
    assert line.startswith("unhealthy: database: unreachable (")
    assert "s3cret-pw" not in line
    doc = json.loads(run("health", "--json", dsn=through).stdout)
    assert doc["healthy"] is False and doc["checks"]["schema"] == "not run"
    assert "s3cret-pw" not in json.dumps(doc)


def test_health_fails_when_a_migration_is_missing(migrated_dsn: str, conn: Any, table: str) -> None:
    latest = max(available(), key=lambda m: m.version)
    conn.execute(
        "DELETE FROM outbox_celery_migrations WHERE table_name = %s AND version = %s", [table, latest.version]
    )
    line = unhealthy(run("health", dsn=migrated_dsn))
    behind = f"{table} is behind: pending {latest.version:04d}_{latest.name} (run `outbox-celery migrate`)"
    assert line == f"unhealthy: schema: {behind}"
    assert json.loads(run("health", "--json", dsn=migrated_dsn).stdout)["checks"]["schema"] == behind
    # A readiness probe of the database alone still passes.
    assert ok(run("health", "--check", "database", dsn=migrated_dsn)).strip() == "ok: database ok"


def test_health_fails_when_claims_stopped(migrated_dsn: str, conn: Any, table: str) -> None:
    ids = add(conn, 2, table=table, event_type="order.created")
    # Ready for 40 s, and nobody claimed them: more than 6 claim intervals of 5 s.
    update(conn, table, ids, "available_at = now() - interval '40 seconds'")
    line = unhealthy(run("health", dsn=migrated_dsn))
    assert line.startswith(
        "unhealthy: claims: overdue: 2 ready message(s) unclaimed past 6 claim intervals (30s),"
        " the oldest ('order.created') for 4"
    ), line
    # Within the bound of a slower claim interval, or of more intervals: on time.
    assert ok(run("health", "--claim-interval", "10s", dsn=migrated_dsn)).startswith("ok:")
    assert ok(run("health", "--claim-intervals", "9", dsn=migrated_dsn)).startswith("ok:")
    assert ok(run("health", "--check", "database", "--check", "schema", dsn=migrated_dsn)).startswith("ok:")
    # A paused event type waits on purpose.
    with psycopg.connect(migrated_dsn, autocommit=True) as c:
        ops.pause(c, table, "order.created")
    assert ok(run("health", dsn=migrated_dsn)).startswith("ok:")


def test_a_held_horizon_is_a_warning_not_a_failure(
    migrated_dsn: str, table: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(health, "HORIZON_WARNING_SECONDS", 0.0)
    with psycopg.connect(migrated_dsn, application_name="nightly-report") as held:
        pid = held.info.backend_pid
        held.execute("SELECT pg_current_xact_id()")  # wrote, then left idle in transaction
        result = health.check(migrated_dsn, table, claim_interval=5.0)
    assert result.healthy, result
    [warning] = result.warnings
    assert warning.startswith(f"the xmin horizon is held by transaction {pid} (nightly-report)")
    assert result.line().startswith("ok: database ok, schema ok, claims ok; warning: the xmin horizon")


def test_a_table_never_migrated_is_unhealthy(dsn: str, conn: Any) -> None:
    line = unhealthy(run("health", "--table", "nowhere", dsn=dsn))
    assert line == "unhealthy: schema: table nowhere was never migrated: run `outbox-celery migrate`"


def test_health_with_the_app_fails_when_its_broker_is_unreachable(migrated_dsn: str, broker_url: str) -> None:
    # A probe of a Celery deployment sees the broker (the app's, -A): through a proxy to the real
    # Redis or RabbitMQ, then with the proxy frozen (connections accepted, never answered), then
    # on a port nothing listens on. The database stays up all along.
    parts = urlsplit(broker_url)
    default_port = 6379 if parts.scheme.startswith("redis") else 5672
    proxy = FreezableProxy((parts.hostname or "127.0.0.1", parts.port or default_port))
    try:
        through = urlunsplit(parts._replace(netloc=parts.netloc.rsplit(":", 1)[0] + f":{proxy.port}"))
        up = ok(cli("health", "-A", APP, dsn=migrated_dsn, CLI_APP_BROKER=through))
        assert up.strip() == "ok: database ok, schema ok, claims ok, broker ok"
        proxy.freeze()
        started = time.monotonic()
        frozen = unhealthy(
            cli("health", "-A", APP, "--timeout", "2s", dsn=migrated_dsn, CLI_APP_BROKER=through)
        )
        assert frozen.startswith(f"unhealthy: broker: unreachable ({parts.scheme}://"), frozen
        assert time.monotonic() - started < 60  # bounded by the timeout, not by the kernel's retries
    finally:
        proxy.close()

    user = "guest" if parts.scheme.startswith("amqp") else ""
    closed = f"{parts.scheme}://{user}:s3cret-pw@127.0.0.1:{free_port()}{parts.path or '/'}"
    line = unhealthy(cli("health", "-A", APP, "--timeout", "2s", dsn=migrated_dsn, CLI_APP_BROKER=closed))
    assert line.startswith(f"unhealthy: broker: unreachable ({parts.scheme}://{user}:**@127.0.0.1:"), line
    assert "s3cret-pw" not in line
    result = cli("health", "-A", APP, "--json", "--timeout", "2s", dsn=migrated_dsn, CLI_APP_BROKER=closed)
    assert result.returncode == 1 and "s3cret-pw" not in result.stdout + result.stderr
    doc = json.loads(result.stdout)
    assert doc["checks"]["database"] == "ok" and doc["checks"]["broker"].startswith("unreachable (")
    assert doc["reason"] == "broker: " + doc["checks"]["broker"]
    # The broker alone, as a probe of it.
    assert unhealthy(cli("health", "-A", APP, "--check", "broker", dsn=migrated_dsn, CLI_APP_BROKER=closed))
    # Without the app nothing changes: the broker is not known, not checked.
    assert ok(run("health", dsn=migrated_dsn)).strip() == "ok: database ok, schema ok, claims ok"
    assert one_line_error(run("health", "--check", "broker", dsn=migrated_dsn)) == (
        "Error: the broker check needs the app: pass -A module:outbox"
    )
