"""The demo command's engine (``python -m examples.demo``) run as a subprocess, checked against
the database it wrote to and against the process table.

The runs use the test fixtures' PostgreSQL (a fresh database each) and broker (a Redis database
number of their own) where possible; one run is fully embedded, with Flower, as ``make demo``
on a fresh machine. The receiver is told to misbehave (429 with Retry-After, connections dropped
after commit) so that redeliveries really happen; the checks are that each idempotency key has
one effect anyway, and that no process outlives the demo.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
import psycopg
import pytest
from psycopg.rows import dict_row
from support.brokers import fresh_redis_db

from outbox_celery import Store
from outbox_celery.testing import embedded_postgres, free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# Outbox rows per order: created, paid to its two subscriptions (webhook, receipt), shipped, and
# three status changes; the receiver sees every one but the receipt's.
ROWS_PER_ORDER = 7
WEBHOOK_EVENTS_PER_ORDER = 6
RECEIPT_ROUTE = "order.paid@receipt"
# Seconds; generous bounds for a loaded 2-core machine. They bound waiting, never assert speed.
RUN_TIMEOUT = 240.0


def _env(**changes: str | None) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("OUTBOX_DSN", "CELERY_BROKER_URL", "RECEIVER_DSN", "WEBHOOK_URL"):
        env.pop(name, None)
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    env["PYTHONUNBUFFERED"] = "1"
    return env


class DemoRun:
    """``python -m examples.demo`` in its own session, its output collected, its descendants
    recorded (pid and start time) every 0.2 s while it runs."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "examples.demo", *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.seen: dict[int, float] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._tracker = threading.Thread(target=self._track, daemon=True)
        self._reader.start()
        self._tracker.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def _track(self) -> None:
        try:
            me = psutil.Process(self.proc.pid)
        except psutil.NoSuchProcess:
            return
        while self.proc.poll() is None:
            try:
                for child in me.children(recursive=True):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        self.seen.setdefault(child.pid, child.create_time())
            except psutil.NoSuchProcess:
                return
            time.sleep(0.2)

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for_line(self, predicate: Any, timeout: float) -> str:
        """The first output line for which ``predicate(line)`` holds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if predicate(line):
                    return line
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no such line in the demo's output:\n{self.output}")

    def wait(self, timeout: float = RUN_TIMEOUT) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the demo did not finish in {timeout:.0f}s:\n{self.output}") from None
        self._reader.join(5)
        self._tracker.join(5)
        return rc

    def survivors(self) -> list[psutil.Process]:
        """Descendants seen during the run that are still alive (same pid and start time)."""
        alive = []
        for pid, started in self.seen.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                continue
        return alive

    def kill_everything(self) -> None:
        """Teardown safety net: whatever is left of the run is killed."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for p in self.survivors():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


@pytest.fixture
def demo_runs() -> Iterator[list[DemoRun]]:
    """Runs started by a test; killed (with every descendant) at teardown whatever happened."""
    runs: list[DemoRun] = []
    yield runs
    for run in runs:
        run.kill_everything()


def _start(runs: list[DemoRun], args: list[str], env: dict[str, str]) -> DemoRun:
    run = DemoRun(args, env)
    runs.append(run)
    return run


def _assert_nothing_left(run: DemoRun, *markers: str) -> None:
    # The demo's own children (workers and their pool processes, beat, Flower, the receiver,
    # the API) were seen while it ran; none may outlive it.
    assert run.seen, "no child process was ever seen: the tracker did not work"
    left = run.survivors()
    assert not left, f"processes outlived the demo: {[(p.pid, p.cmdline()) for p in left]}"
    if markers:
        # Embedded PostgreSQL and Redis daemonize (they are nobody's descendants): find them by
        # their data directory or listening address on their command line.
        mine = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            cmdline = " ".join(p.info["cmdline"] or [])
            if any(m in cmdline for m in markers) and p.pid != os.getpid():
                mine.append((p.pid, cmdline))
        assert not mine, f"embedded servers still running: {mine}"


def _verify_database(dsn: str, summary: dict[str, Any], orders: int) -> dict[str, int]:
    """Check the run against what PostgreSQL holds; return the independently counted numbers."""
    source = summary["source"]
    with psycopg.connect(dsn, autocommit=True) as conn, conn.cursor(row_factory=dict_row) as cur:
        ids = [r["id"] for r in cur.execute("SELECT id FROM orders WHERE source = %s", [source])]
        assert len(ids) == orders
        events = cur.execute(
            "SELECT id, event_type, status, attempts, lease_version FROM outbox"
            " WHERE aggregate_type = 'order' AND aggregate_id = ANY(%s) ORDER BY id",
            [[str(i) for i in ids]],
        ).fetchall()
        assert len(events) == orders * ROWS_PER_ORDER
        assert {e["status"] for e in events} == {"done"}, [e for e in events if e["status"] != "done"]
        routes = [e["event_type"] for e in events]
        assert routes.count("order.paid@webhook") == routes.count(RECEIPT_ROUTE) == orders, routes
        prefix = Store("outbox").key_prefix(conn)
        keys = {f"{prefix}{e['id']}" for e in events if e["event_type"] != RECEIPT_ROUTE}

        # Every order was paid and has exactly one receipt, for its total, written by its
        # order.paid@receipt delivery (transactional: the insert committed with that done).
        receipts = cur.execute(
            "SELECT r.order_id, r.total_cents = o.total_cents AS right_total, x.event_type, x.status"
            " FROM receipts AS r JOIN orders AS o ON o.id = r.order_id"
            " LEFT JOIN outbox AS x ON x.id = r.outbox_id WHERE r.order_id = ANY(%s)",
            [ids],
        ).fetchall()
        assert sorted(r["order_id"] for r in receipts) == sorted(ids)
        assert all(
            r["right_total"] and (r["event_type"], r["status"]) == (RECEIPT_ROUTE, "done") for r in receipts
        )

        # The inbox holds each delivered event's idempotency key exactly once (it is the
        # primary key), and nothing else for these orders.
        inbox = cur.execute(
            "SELECT idempotency_key FROM receiver.webhook_inbox WHERE idempotency_key IN"
            " (SELECT idempotency_key FROM receiver.requests WHERE order_id = ANY(%s))",
            [ids],
        ).fetchall()
        assert sorted(r["idempotency_key"] for r in inbox) == sorted(keys)

        # Every request the receiver got, per key: at most one had an effect.
        requests = cur.execute(
            "SELECT idempotency_key, outcome, id FROM receiver.requests WHERE order_id = ANY(%s) ORDER BY id",
            [ids],
        ).fetchall()
        by_key: dict[str, list[str]] = {}
        for r in requests:
            by_key.setdefault(r["idempotency_key"], []).append(r["outcome"])
        assert set(by_key) == keys
        # More claims than attempts: a Defer (an order.shipped of an unpaid order) or a
        # RateLimited after a 429 (its attempt is refunded too); nothing else holds a row back.
        throttled = {k for k, outcomes in by_key.items() if "throttled" in outcomes}
        held_back = [e for e in events if e["lease_version"] > e["attempts"]]
        unexplained = [
            e
            for e in held_back
            if e["event_type"] != "order.shipped" and f"{prefix}{e['id']}" not in throttled
        ]
        assert not unexplained, unexplained
        for key, outcomes in by_key.items():
            applied = [o for o in outcomes if o in ("applied", "applied_dropped")]
            assert len(applied) == 1, (key, outcomes)
            if "applied_dropped" in outcomes:
                # The sender never got an answer, so it retried: the redelivery found the key.
                assert outcomes[outcomes.index("applied_dropped") + 1 :].count("duplicate") >= 1, (
                    key,
                    outcomes,
                )

        # The effect: each order was changed once per event, status changes in sequence.
        views = cur.execute(
            "SELECT order_id, events, status, status_seq, out_of_order, paid, shipped"
            " FROM receiver.orders WHERE order_id = ANY(%s)",
            [ids],
        ).fetchall()
        assert len(views) == orders
        for v in views:
            assert v["events"] == WEBHOOK_EVENTS_PER_ORDER, v
            assert (v["status"], v["status_seq"], v["out_of_order"]) == ("completed", 3, 0), v
            assert v["paid"] and v["shipped"], v

        counted = {
            "orders": len(ids),
            "events": len(events),
            "done": len(events),
            "dead": 0,
            "attempts": sum(e["attempts"] for e in events),
            "retried": sum(1 for e in events if e["attempts"] > 1),
            "inbox": len(inbox),
            "effects": sum(v["events"] for v in views),
            "requests": len(requests),
            "applied": sum(1 for r in requests if r["outcome"] in ("applied", "applied_dropped")),
            "dropped": sum(1 for r in requests if r["outcome"] == "applied_dropped"),
            "duplicates": sum(1 for r in requests if r["outcome"] == "duplicate"),
            "throttled": sum(1 for r in requests if r["outcome"] == "throttled"),
            # A Defer refunds its attempt but not its claim (every claim bumps lease_version).
            "deferred": sum(1 for e in events if e["lease_version"] > e["attempts"]),
            "receipts": len(receipts),
            "paid": len(ids),
        }
    # The summary the demo printed is what the database says.
    snapshot = summary["snapshot"]
    assert {k: snapshot[k] for k in counted} == counted
    assert summary["ok"] is True
    return counted


def test_demo_delivers_each_event_once_in_effect_despite_redeliveries(
    dsn: str, redis_url: str, tmp_path: Path, demo_runs: list[DemoRun]
) -> None:
    orders = 20
    summary_file = tmp_path / "summary.json"
    run = _start(
        demo_runs,
        [
            "--orders",
            str(orders),
            "--no-flower",
            "--state-dir",
            str(tmp_path / "state"),
            "--json",
            str(summary_file),
            # Misbehave often, so that a small run surely has redeliveries and throttling.
            "--max-rate",
            "10",
            "--drop-every",
            "3",
            "--invoice-every",
            "4",
        ],
        _env(OUTBOX_DSN=dsn, CELERY_BROKER_URL=fresh_redis_db(redis_url, 11)),
    )
    rc = run.wait()
    assert rc == 0, run.output
    assert "Summary (every number read from PostgreSQL)" in run.output
    assert "FAILED" not in run.output

    summary = json.loads(summary_file.read_text())
    counted = _verify_database(dsn, summary, orders)
    # The faults really happened, and were absorbed.
    assert counted["dropped"] >= 1 and counted["duplicates"] >= counted["dropped"], counted
    assert counted["throttled"] >= 1 and counted["retried"] >= 1, counted
    # One order in 4 was shipped before it was paid: its notification was deferred (the demo pays
    # those orders once each of their order.shipped events has been deferred).
    assert counted["deferred"] >= orders // 4, counted
    # Every process the demo started (workers per queue, beat, receiver, API, the read-only
    # console) was seen and is gone.
    assert set(summary["pids"]) == {
        "receiver",
        "api",
        "worker-claim",
        "worker-webhooks",
        "worker-fulfilment",
        "beat",
        "console",
    }
    assert set(summary["pids"].values()) <= set(run.seen)
    _assert_nothing_left(run)


def test_demo_fully_embedded_with_flower(tmp_path: Path, demo_runs: list[DemoRun]) -> None:
    """``make demo`` on a machine with no services: embedded PostgreSQL 18 and Redis, Flower."""
    orders = 8
    state = tmp_path / "state"
    summary_file = tmp_path / "summary.json"
    flower_port, console_port = free_port(), free_port()
    run = _start(
        demo_runs,
        [
            *("--orders", str(orders), "--state-dir", str(state)),
            *("--json", str(summary_file), "--flower-port", str(flower_port)),
            *("--console-port", str(console_port)),
        ],
        _env(),
    )
    # Flower is announced once it answers, and answers while the demo runs.
    line = run.wait_for_line(lambda s: s.strip().startswith("Flower: http://"), timeout=150)
    url = line.split()[1]
    assert url == f"http://127.0.0.1:{flower_port}"
    with urllib.request.urlopen(f"{url}/healthcheck", timeout=10) as response:
        assert response.status == 200
    with urllib.request.urlopen(f"{url}/workers", timeout=10) as response:
        assert response.status == 200
    # The operator console is announced beside Flower (docs/console.md), read-only.
    line = run.wait_for_line(lambda s: s.strip().startswith("Console: http://"), timeout=30)
    console = line.split()[1]
    assert console == f"http://127.0.0.1:{console_port}/"
    with urllib.request.urlopen(console, timeout=10) as response:
        assert response.status == 200 and "read-only" in response.read().decode()

    rc = run.wait()
    assert rc == 0, run.output
    assert "PostgreSQL 18" in run.output
    assert "embedded Redis" in run.output
    summary = json.loads(summary_file.read_text())
    assert "flower" in summary["pids"]
    redis_line = next(s for s in run.lines if "embedded Redis at redis://" in s)
    redis_address = urlsplit(redis_line.split(" at ")[1].split()[0]).netloc
    _assert_nothing_left(run, str(state), f"redis-server {redis_address}")

    # The embedded cluster kept the run's data: check it independently.
    with embedded_postgres(state / "pg") as dsn:
        _verify_database(dsn, summary, orders)


@pytest.mark.parametrize(
    ("signals", "redis_db"),
    [([signal.SIGINT], 12), ([signal.SIGTERM, signal.SIGTERM], 14)],
    ids=["ctrl-c", "term-twice"],
)
def test_demo_interrupted_leaves_nothing_running(
    signals: list[signal.Signals],
    redis_db: int,
    dsn: str,
    redis_url: str,
    tmp_path: Path,
    demo_runs: list[DemoRun],
) -> None:
    """Ctrl-C in a terminal signals the whole foreground process group; a second signal during
    the shutdown only hurries it. Either way nothing the demo started survives it."""
    run = _start(
        demo_runs,
        ["--orders", "5000", "--no-flower", "--state-dir", str(tmp_path / "state")],
        _env(OUTBOX_DSN=dsn, CELERY_BROKER_URL=fresh_redis_db(redis_url, redis_db)),
    )
    # Interrupt it in full flight: orders being pushed, deliveries under way.
    run.wait_for_line(lambda s: " done " in s and "done 0 " not in s, timeout=150)
    assert len(run.seen) >= 6
    for n, sig in enumerate(signals):
        if n:
            time.sleep(0.5)
        os.killpg(run.proc.pid, sig)
    rc = run.wait(timeout=90)
    assert rc == 130, run.output
    assert "interrupted" in run.output
    assert "Summary" not in run.output
    _assert_nothing_left(run)
