"""``stats`` and the metrics scrape read a bounded number of index entries, whatever the table holds.

Each status is read up to a cap (a count that reached it is a lower bound, flagged), and the done
rows only from the newest end of ``done_idx``: the done history and a large backlog cost a scrape
nothing more (docs/operations.md, "What stats and the scrape read").
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outbox_celery import TableName, ops
from outbox_celery.errors import AdminError

from .helpers import add

pytest.importorskip("prometheus_client")

from outbox_celery.ops import snapshot
from outbox_celery.ops.metrics import DEFAULT_METRICS_CAP, OutboxCollector


def _set(conn: psycopg.Connection[Any], table: str, ids: list[int], assignments: str) -> None:
    """``UPDATE table SET <assignments> WHERE id = ANY(ids)``; assignments are written by the test."""
    query = sql.SQL("UPDATE {} SET " + assignments + " WHERE id = ANY(%s)").format(
        TableName.parse(table).identifier()
    )
    conn.execute(query, [ids])


def test_stats_counts_past_the_cap_are_lower_bounds_and_flagged(
    conn: psycopg.Connection[Any], table: str
) -> None:
    ids = add(conn, 30, table=table)
    _set(conn, table, ids[:15], "status = 'done', done_at = now() - interval '10 minutes'")
    _set(conn, table, ids[15:20], "status = 'done', done_at = now()")
    _set(conn, table, ids[20:22], "status = 'processing', lease_until = now() + interval '1 hour'")
    _set(conn, table, ids[22:25], "status = 'dead', attempts = 5")
    exact_counts = {"pending": 5, "processing": 2, "done": 20, "dead": 3}

    exact = ops.stats(conn, table, cap=None)
    assert exact.counts == exact_counts
    assert exact.capped == dict.fromkeys(exact_counts, False)
    assert exact.done_last_minute == 5

    # A cap above every live status: those are exact; the done read stops at the cap.
    s = ops.stats(conn, table, cap=10)
    assert {k: v for k, v in s.counts.items() if k != "done"} == {"pending": 5, "processing": 2, "dead": 3}
    assert s.capped == {"pending": False, "processing": False, "done": True, "dead": False}
    assert s.counts["done"] >= 10  # past the cap: an estimate, never below what was read
    assert s.done_last_minute == 5  # the newest end of done_idx: all of the last minute
    assert s.ready == 5 and s.event_types[0].pending == 5

    # A cap below them: lower bounds, flagged, and figures derived from the rows read agree.
    low = ops.stats(conn, table, cap=3)
    assert low.counts["pending"] == 3 and low.capped["pending"]
    assert low.counts["processing"] == 2 and not low.capped["processing"]
    assert low.counts["dead"] == 3 and low.capped["dead"]  # reached the cap: "at least 3"
    assert low.counts["done"] >= 3 and low.capped["done"]
    assert low.done_last_minute == 3
    assert low.ready == 3
    assert sum(a.pending for a in low.attempts) == 3

    with pytest.raises(AdminError):
        ops.stats(conn, table, cap=0)


def test_unclaimed_reads_at_most_the_cap_and_keeps_the_oldest_wait(
    conn: psycopg.Connection[Any], table: str
) -> None:
    ids = add(conn, 6, table=table)
    _set(conn, table, ids, "available_at = now() - make_interval(mins => id::int)")
    oldest = conn.execute(
        sql.SQL("SELECT extract(epoch FROM now() - min(available_at))::float8 FROM {}").format(
            TableName.parse(table).identifier()
        )
    ).fetchone()
    assert oldest is not None
    [every] = ops.unclaimed(conn, table, older_than=30, cap=None)
    assert every.messages == 6
    [capped] = ops.unclaimed(conn, table, older_than=30, cap=4)
    assert capped.messages == 4  # a lower bound: the first 4 entries of pending_idx
    assert capped.oldest_wait == pytest.approx(oldest[0], abs=5)  # the oldest comes first


def _tuples_read(conn: psycopg.Connection[Any], table: str) -> int:
    """Index entries and heap tuples read from ``table`` by scans, as the statistics count them."""
    conn.execute("SELECT pg_stat_clear_snapshot()")
    name = TableName.parse(table).identifier().as_string(conn)
    row = conn.execute(
        "SELECT coalesce((SELECT sum(idx_tup_read) FROM pg_stat_user_indexes"
        " WHERE relid = %(t)s::regclass), 0)"
        " + coalesce((SELECT seq_tup_read FROM pg_stat_user_tables WHERE relid = %(t)s::regclass), 0)",
        {"t": name},
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_scrape_reads_neither_the_done_history_nor_every_unfinished_row(
    conn: psycopg.Connection[Any], migrated_dsn: str, table: str
) -> None:
    if conn.info.server_version < 150000:
        pytest.skip("pg_stat_force_next_flush() needs PostgreSQL 15")
    done, pending = 20_000, 3_000
    conn.execute(
        sql.SQL(
            "INSERT INTO {} (event_type, aggregate_type, aggregate_id, payload, status, done_at)"
            " SELECT 'thing.happened', 'thing', g::text, '{{}}'::jsonb,"
            " CASE WHEN g <= %(done)s THEN 'done' ELSE 'pending' END,"
            " CASE WHEN g <= %(done)s THEN now() - make_interval(secs => g) END"
            " FROM generate_series(1, %(n)s) AS g"
        ).format(TableName.parse(table).identifier()),
        {"done": done, "n": done + pending},
    )
    conn.execute(sql.SQL("ANALYZE {}").format(TableName.parse(table).identifier()))
    with psycopg.connect(migrated_dsn, autocommit=True) as scraper:
        collector = OutboxCollector(lambda: contextlib.nullcontext(scraper), table)
        list(collector.collect())  # warm: plans
        scraper.execute("SELECT pg_stat_force_next_flush()")
        scraper.execute("SELECT 1")
        before = _tuples_read(conn, table)
        families = {f.name: f for f in collector.collect()}
        scraper.execute("SELECT pg_stat_force_next_flush()")
        scraper.execute("SELECT 1")
        read = _tuples_read(conn, table) - before

    # At most a cap of done entries and a cap of pending ones (plus a few), not 23,000.
    assert read <= 2 * DEFAULT_METRICS_CAP + 100, read
    samples = {(s.name, s.labels.get("status")): s.value for f in families.values() for s in f.samples}
    assert samples[("outbox_messages", "pending")] == DEFAULT_METRICS_CAP
    assert samples[("outbox_messages_capped", "pending")] == 1
    assert samples[("outbox_messages_capped", "dead")] == 0
    assert samples[("outbox_messages", "done")] >= DEFAULT_METRICS_CAP
    assert samples[("outbox_messages_capped", "done")] == 1
    assert 50 <= samples[("outbox_done_last_minute_messages", None)] <= 59  # done 1 s apart


def test_the_stats_command_shows_lower_bounds_and_exact_counts_on_request(
    conn: psycopg.Connection[Any], migrated_dsn: str, table: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner

    from outbox_celery.cli import cli

    ids = add(conn, 5, table=table)
    _set(conn, table, ids[:3], "status = 'done', done_at = now()")
    runner = CliRunner()
    args = ["--dsn", migrated_dsn, "--table", table, "stats"]
    exact = json.loads(runner.invoke(cli, [*args, "--exact", "--json"], catch_exceptions=False).output)
    assert exact["cap"] is None and exact["counts"]["done"] == 3 and exact["done_last_minute"] == 3
    assert not any(exact["capped"].values())

    monkeypatch.setattr(snapshot, "DEFAULT_STATS_CAP", 2)  # what the command passes when not --exact
    text = runner.invoke(cli, args, catch_exceptions=False).output
    assert re.search(r"^pending +2\+ ", text, re.M), text
    assert re.search(r"^done +~\d+ +2\+ in the last minute; estimated", text, re.M), text
    assert "N+: at least N (each status is read up to 2 index entries" in text


def test_the_exporter_command_caps_as_the_collector_does() -> None:
    from outbox_celery.cli import cli

    [cap] = [p for p in cli.commands["metrics"].params if p.name == "cap"]  # type: ignore[attr-defined]
    assert cap.default == DEFAULT_METRICS_CAP
