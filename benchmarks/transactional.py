"""Transactional handlers beside plain handlers doing the same write, in the plain loop.

One process, no Celery: claim -> no-op publish -> fenced start -> handler -> done, as
:mod:`benchmarks.plain` does, with a handler that inserts one effect row. The plain handler
writes it on a pooled connection of its own (its own transaction; the done follows in another,
relaxed as usual); the transactional handler writes it inside the transaction whose last
statement is the fenced done (one durable commit for both). Runs are interleaved.

After its run, the library resets the transactional handler's connection (one round trip:
``SESSION_RESET``), or discards it when the handler changed its Python side (DESIGN invariant
20); the benchmark's handler changes nothing there, so ``library`` measures the reset. Two
baselines: ``kept``, the connection handed back to the pool as the handler left it (unsafe,
measurement only), and ``discarded``, the connection closed after every run (the pool opens
another in the background).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql
from psycopg_pool import ConnectionPool

from outbox_celery import OutboxConfig, TableName, migrate
from outbox_celery.claim.executor import Claimed
from outbox_celery.handlers import HandlerSpec
from outbox_celery.message import Message
from outbox_celery.testing import InProcess
from outbox_celery.transactional import _DISCARDED, ConnectionSource, PsycopgTransaction

from .pipeline import drop_table
from .plain import fill_pending

__all__ = ["CONNECTION_HANDLING", "EffectResult", "run_effect"]

EFFECT = "INSERT INTO bench_effects (outbox_id, lease_version) VALUES (%s, %s)"

#: What becomes of a transactional handler's connection after its run.
CONNECTION_HANDLING = ("library", "kept", "discarded")


class _Kept(PsycopgTransaction):
    """Baseline only: the connection goes back to the pool as the handler left it (unsafe)."""

    @contextlib.contextmanager
    def begin(self, connection: ConnectionSource) -> Iterator[tuple[Any, psycopg.Connection[Any]]]:
        with connection() as conn, conn.transaction():
            yield conn, conn


class _Discarded(PsycopgTransaction):
    """Baseline only: the connection is closed after every run (the pool opens another)."""

    @contextlib.contextmanager
    def begin(self, connection: ConnectionSource) -> Iterator[tuple[Any, psycopg.Connection[Any]]]:
        with connection() as conn:
            try:
                with conn.transaction():
                    yield conn, conn
            finally:
                _DISCARDED.add(conn)  # the pool's warning about it, as for the library's discards
                conn.close()


@dataclass
class EffectResult:
    """One run of the loop with an effect-writing handler."""

    label: str
    transactional: bool
    n: int
    seconds: float
    effects: int
    handling: str = "library"

    @property
    def rate(self) -> float:
        """Messages per second."""
        return self.n / self.seconds if self.seconds > 0 else 0.0


def run_effect(
    dsn: str, n: int, *, label: str, transactional: bool, batch_size: int = 200, handling: str = "library"
) -> EffectResult:
    """Drain ``n`` pending rows whose handler inserts one effect row each.

    :param handling: for a transactional handler, what becomes of its connection (one of
        :data:`CONNECTION_HANDLING`; ``library`` is what the library does).
    """
    table = f"bench_tx_{label.replace('-', '_')}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        drop_table(dsn, table)
        migrate(admin, table)
        admin.execute("DROP TABLE IF EXISTS bench_effects")
        admin.execute(
            "CREATE TABLE bench_effects (n bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
            " outbox_id bigint NOT NULL, lease_version bigint NOT NULL)"
        )
        fill_pending(admin, table, n, event_type="bench.effect")
        admin.execute(sql.SQL("ANALYZE {}").format(TableName.parse(table).identifier()))
        config = OutboxConfig(dsn=dsn, table=TableName.parse(table), batch_size=batch_size, lease=60.0)
        with ConnectionPool(dsn, min_size=3, max_size=3, kwargs={"autocommit": True}) as pool:
            pool.wait()

            @contextlib.contextmanager
            def connection() -> Iterator[psycopg.Connection[Any]]:
                with pool.connection() as conn:
                    yield conn

            def plain(message: Message) -> None:
                with connection() as conn:
                    conn.execute(EFFECT, [message.id, message.lease_version])

            def in_transaction(message: Message, conn: psycopg.Connection[Any]) -> None:
                conn.execute(EFFECT, [message.id, message.lease_version])

            kind = {"library": PsycopgTransaction, "kept": _Kept, "discarded": _Discarded}[handling]()
            spec = (
                HandlerSpec("bench.effect", in_transaction, "q", transaction=kind)
                if transactional
                else HandlerSpec("bench.effect", plain, "q")
            )
            dispatcher = InProcess(config, connection, {"bench.effect": spec})
            published: list[Claimed] = []

            def publish(claims: Sequence[Claimed]) -> int:
                published.extend(claims)
                return len(claims)

            delivered = 0
            started = time.perf_counter()
            while delivered < n:
                run = dispatcher.claim_and_publish(publish, owner="bench")
                if not published and run.claimed == 0:
                    raise RuntimeError(f"loop stalled after {delivered} of {n}: {run.as_dict()}")
                for c in published:
                    if dispatcher.deliver(c.id, c.lease_version) == "done":
                        delivered += 1
                published.clear()
            seconds = time.perf_counter() - started
        row = admin.execute("SELECT count(*) FROM bench_effects").fetchone()
        effects = int(row[0]) if row else 0
        admin.execute("DROP TABLE bench_effects")
    drop_table(dsn, table)
    return EffectResult(
        label=label, transactional=transactional, n=n, seconds=seconds, effects=effects, handling=handling
    )
