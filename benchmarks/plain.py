"""The plain dispatcher loop: claim -> no-op publish -> fenced start + finalize, in one process.

No Celery and no broker: :class:`~outbox_celery.worker.deliverer.InProcess` and
:class:`~outbox_celery.db.store.Store` driven directly over a psycopg pool, as a worker would, so
the difference to the end-to-end run is what the Celery hop costs. A second, traced pass counts
what the database sees per delivered message: protocol round trips (one per ``Sync`` or simple
``Query``, read from libpq's trace), statements, and transactions (``pg_stat_database``).
"""

from __future__ import annotations

import contextlib
import re
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import pq, sql
from psycopg_pool import ConnectionPool

from outbox_celery import OutboxConfig, Store, TableName, migrate
from outbox_celery.claim.executor import Claimed
from outbox_celery.handlers import HandlerSpec
from outbox_celery.message import Message
from outbox_celery.testing import InProcess

from .measure import pg_counters
from .pipeline import drop_table

__all__ = ["PlainResult", "fill_pending", "run_plain"]


@dataclass
class PlainResult:
    """One plain-loop run."""

    label: str
    n: int
    seconds: float
    claim_runs: int
    per_msg: dict[str, float] = field(default_factory=dict)
    round_trips_by_step: dict[str, float] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        """Messages per second."""
        return self.n / self.seconds if self.seconds > 0 else 0.0


def fill_pending(
    conn: psycopg.Connection[Any], table: str, n: int, *, event_type: str = "bench.noop"
) -> None:
    """Insert ``n`` due pending rows with one ``INSERT ... SELECT generate_series``."""
    conn.execute(
        sql.SQL(
            "INSERT INTO {} (event_type, aggregate_type, aggregate_id, payload, available_at)"
            " SELECT %s, 'bench', g::text, jsonb_build_object('i', g), now() - interval '1 second'"
            " FROM generate_series(1, %s) AS g"
        ).format(TableName.parse(table).identifier()),
        [event_type, n],
    )


def _noop(message: Message) -> None:
    """The no-op handler."""


# Protocol messages in libpq's trace (PQtrace, regress mode, no timestamps); a message may span
# several lines when a query text does.
_MESSAGE = re.compile(r"^[FB]\t\d+\t", re.MULTILINE)
_QUERY = re.compile(r'^F\t\d+\tQuery\t "(.*)"\s*$', re.DOTALL)
_PARSE = re.compile(r'^F\t\d+\tParse\t "([^"]*)" "(.*)" \d+[ N]*\s*$', re.DOTALL)
_BIND = re.compile(r'^F\t\d+\tBind\t "[^"]*" "([^"]*)"')
_READY = re.compile(r"^B\t\d+\tReadyForQuery\t")


def _messages(text: str) -> Iterator[str]:
    starts = [m.start() for m in _MESSAGE.finditer(text)]
    for a, b in zip(starts, [*starts[1:], len(text)], strict=True):
        yield text[a:b]


def _classify(trace: Path, names: dict[str, str]) -> Counter[str]:
    """Round trips per step: each ReadyForQuery ends one, labelled by the statement it answered.

    ``BEGIN``/``COMMIT`` are labelled ``begin``/``commit``; named queries by their name in
    ``queries.sql``; anything else ``other``.
    """
    prepared: dict[str, str] = {}
    pending: str | None = None
    counts: Counter[str] = Counter()
    for message in _messages(trace.read_text(errors="replace")):
        if m := _QUERY.match(message):
            text = m.group(1).strip()
            pending = (
                text.lower() if text.upper() in ("BEGIN", "COMMIT", "ROLLBACK") else names.get(text, "other")
            )
        elif m := _PARSE.match(message):
            label = names.get(m.group(2).strip(), "other")
            if m.group(1):
                prepared[m.group(1)] = label
            pending = label
        elif m := _BIND.match(message):
            if m.group(1):
                pending = prepared.get(m.group(1), "other")
        elif _READY.match(message):
            counts[pending or "other"] += 1
            pending = None
    return counts


def _statement_names(store: Store, conn: psycopg.Connection[Any]) -> dict[str, str]:
    """Map each named query's wire text (``$1`` placeholders) to its name."""
    names = {}
    for name, composed in store.queries.items():
        text = composed.as_string(conn)
        # psycopg turns %(x)s placeholders into $n in order of first appearance.
        order: dict[str, int] = {}

        def number(m: re.Match[str], order: dict[str, int] = order) -> str:
            return f"${order.setdefault(m.group(1), len(order) + 1)}"

        names[re.sub(r"%\((\w+)\)s", number, text).strip()] = name
    for sql_text in ("SELECT pg_stat_clear_snapshot()",):
        names[sql_text] = "stats"
    return names


def run_plain(
    dsn: str,
    n: int,
    *,
    label: str,
    store: Store | None = None,
    batch_size: int = 200,
    trace: bool = False,
) -> PlainResult:
    """Drain ``n`` pending rows through the plain loop; with ``trace``, count round trips."""
    table = f"bench_plain_{label.replace('-', '_')}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        drop_table(dsn, table)
        migrate(admin, table)
        fill_pending(admin, table, n)
        admin.execute(sql.SQL("ANALYZE {}").format(TableName.parse(table).identifier()))
        config = OutboxConfig(dsn=dsn, table=TableName.parse(table), batch_size=batch_size, lease=60.0)
        store = store or Store(table)
        with contextlib.ExitStack() as stack:
            tracefile: Path | None = None
            configure: Any = None
            if trace:
                folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-trace-")))
                tracefile = folder / "trace.txt"
                handle = stack.enter_context(open(tracefile, "w"))

                def configure(conn: psycopg.Connection[Any]) -> None:
                    conn.pgconn.trace(handle.fileno())
                    conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)

            pool: ConnectionPool[Any] = stack.enter_context(
                ConnectionPool(dsn, min_size=1, max_size=2, kwargs={"autocommit": True}, configure=configure)
            )
            pool.wait()

            @contextlib.contextmanager
            def connection() -> Iterator[psycopg.Connection[Any]]:
                with pool.connection() as conn:
                    yield conn

            dispatcher = InProcess(
                config, connection, {"bench.noop": HandlerSpec("bench.noop", _noop, "q")}, store=store
            )
            published: list[Claimed] = []

            def publish(claims: Sequence[Claimed]) -> int:
                published.extend(claims)
                return len(claims)

            before = pg_counters(admin)
            delivered = 0
            runs = 0
            started = time.perf_counter()
            while delivered < n:
                run = dispatcher.claim_and_publish(publish, owner="plain")
                runs += 1
                if not published and run.claimed == 0:
                    raise RuntimeError(f"plain loop stalled after {delivered} of {n}: {run.as_dict()}")
                for c in published:
                    if dispatcher.deliver(c.id, c.lease_version) == "done":
                        delivered += 1
                published.clear()
            seconds = time.perf_counter() - started
            pool.close()  # its backends flush their statistics as they exit
            steps: Counter[str] = Counter()
            if tracefile is not None:
                handle.flush()
                steps = _classify(tracefile, _statement_names(store, admin))
        time.sleep(0.3)
        after = pg_counters(admin)
    drop_table(dsn, table)
    result = PlainResult(label=label, n=n, seconds=seconds, claim_runs=runs)
    result.per_msg = {
        "transactions": (after["xact_commit"] - before["xact_commit"]) / n,
        "rows_updated": (after["tup_updated"] - before["tup_updated"]) / n,
    }
    if steps:
        result.round_trips_by_step = {k: v / n for k, v in sorted(steps.items())}
        result.per_msg["round_trips"] = sum(steps.values()) / n
    return result
