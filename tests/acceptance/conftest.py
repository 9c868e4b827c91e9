"""Fixtures of the acceptance tests: real worker and beat processes around one test database.

The :class:`Harness` gives each test unique queue names (suffixed with a per-test token, so
leftover messages never cross tests), an :class:`~support.apps.AppSpec` the test adjusts before
starting processes, the processes themselves (always stopped at teardown) and the in-process
twin of the workers' app (to publish or claim by hand). When a test fails, the processes' logs
are printed with the failure.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery
from support.apps import AppSpec, build_app, create_tables
from support.brokers import delete_queues
from support.db import rows, statuses
from support.processes import CeleryProcess, CeleryProcesses, wait_until

from outbox_celery import Event, enqueue_many
from outbox_celery.app.outbox import Outbox

# Seconds; generous bounds for a loaded 2-core machine. They bound waiting, never assert speed.
SETTLE = 90.0

DEFAULT_EVENT = "thing.happened"


class Harness:
    """One test's outbox app, its processes and its database."""

    def __init__(self, *, broker_url: str, dsn: str, conn: psycopg.Connection[Any], table: str, tmp: Path):
        self.token = uuid.uuid4().hex[:10]
        self.broker_url = broker_url
        self.dsn = dsn
        self.conn = conn
        self.table = table
        self.claim_queue = f"outbox.claim.{self.token}"
        self.default_queue = f"outbox.{self.token}"
        self.spec = AppSpec(
            dsn=dsn,
            broker_url=broker_url,
            outbox={
                "table": table,
                "lease": 10.0,
                "claim_interval": 0.3,
                "claim_queue": self.claim_queue,
                "default_queue": self.default_queue,
                "backoff_base": 0.1,
                "backoff_cap": 0.5,
                "retention": None,
            },
            routes={DEFAULT_EVENT: None},
        )
        self.procs = CeleryProcesses(tmp / "celery")
        self._app: tuple[Celery, Outbox] | None = None
        self._extra_queues: set[str] = set()
        self._closed = False

    # -- configuration -------------------------------------------------------------------------

    def q(self, name: str) -> str:
        """A queue name private to this test."""
        queue = f"{name}.{self.token}"
        self._extra_queues.add(queue)
        return queue

    def configure(
        self,
        *,
        routes: dict[str, str | None] | None = None,
        transactional: dict[str, str | None] | None = None,
        batches: dict[str, int] | None = None,
        celery: dict[str, Any] | None = None,
        via_celery_conf: bool | None = None,
        limits: dict[str, dict[str, Any]] | None = None,
        subscriptions: dict[str, dict[str, str | None]] | None = None,
        **outbox: Any,
    ) -> None:
        """Change the app spec (before starting the processes that should see it)."""
        if subscriptions is not None:
            self.spec.subscriptions = {t: dict(names) for t, names in subscriptions.items()}
        if routes is not None:
            self.spec.routes = dict(routes)
        if limits is not None:
            self.spec.limits = dict(limits)
        if transactional is not None:
            self.spec.transactional = dict(transactional)
        if batches is not None:
            self.spec.batches = dict(batches)
        if celery is not None:
            self.spec.celery = dict(celery)
        if via_celery_conf is not None:
            self.spec.via_celery_conf = via_celery_conf
        self.spec.outbox.update(outbox)
        self._close_app()

    @property
    def queues(self) -> list[str]:
        """Claim queue, default queue and every routed queue of the spec."""
        names = [self.claim_queue, self.default_queue]
        names += [q for q in self.spec.routes.values() if q]
        names += [q for q in self.spec.transactional.values() if q]
        names += [q for subs in self.spec.subscriptions.values() for q in subs.values() if q]
        return list(dict.fromkeys(names))

    # -- processes -----------------------------------------------------------------------------

    def worker(self, queues: Sequence[str] | None = None, **kwargs: Any) -> CeleryProcess:
        """A real ``celery worker`` of the test app (all the app's queues unless told)."""
        return self.procs.worker(queues or self.queues, env=self.spec.env(), **kwargs)

    def beat(self, **kwargs: Any) -> CeleryProcess:
        """A real ``celery beat`` of the test app."""
        return self.procs.beat(env=self.spec.env(), **kwargs)

    @property
    def app(self) -> Celery:
        """The in-process twin of the workers' Celery app."""
        return self._twin()[0]

    @property
    def outbox(self) -> Outbox:
        """The in-process twin of the workers' outbox."""
        return self._twin()[1]

    def _twin(self) -> tuple[Celery, Outbox]:
        if self._app is None:
            self._app = build_app(self.spec)
        return self._app

    def _close_app(self) -> None:
        if self._app is not None:
            app, outbox = self._app
            outbox.close()
            app.close()
            self._app = None

    # -- data ----------------------------------------------------------------------------------

    def enqueue(
        self,
        n: int = 1,
        *,
        event_type: str = DEFAULT_EVENT,
        payload: dict[str, Any] | Callable[[int], dict[str, Any]] | None = None,
        ordering_key: str | None = None,
        limit_key: str | Callable[[int], str] | None = None,
    ) -> list[int]:
        """Commit ``n`` events in one transaction; returns their ids. ``limit_key``: theirs, or
        a function of ``i`` giving each its own."""
        events = [
            Event(
                event_type=event_type,
                payload=(payload(i) if callable(payload) else dict(payload or {})) | {"i": i},
                aggregate_type="thing",
                aggregate_id=str(i),
                ordering_key=ordering_key,
                limit_key=limit_key(i) if callable(limit_key) else limit_key,
            )
            for i in range(n)
        ]
        with self.conn.transaction():
            return enqueue_many(self.conn, events, table=self.table)

    def rows(self) -> list[dict[str, Any]]:
        """Every outbox row."""
        return rows(self.conn, self.table)

    def wait_finished(
        self, expected: int, timeout: float = SETTLE, *, statuses_: tuple[str, ...] = ("done",)
    ):
        """Wait until ``expected`` rows are in ``statuses_`` (default: done)."""

        def finished() -> bool:
            counts = statuses(self.conn, self.table)
            return sum(counts[s] for s in statuses_) >= expected

        wait_until(
            finished,
            timeout,
            lambda: (
                f"{expected} row(s) in {statuses_}; have {dict(statuses(self.conn, self.table))}\n"
                + self.procs.logs()
            ),
        )

    def wait(self, predicate: Callable[[], object], timeout: float = SETTLE, what: str = "condition") -> Any:
        """Poll until ``predicate`` holds; the failure message carries the processes' logs."""
        return wait_until(predicate, timeout, lambda: f"{what}\n{self.procs.logs()}")

    def close(self) -> None:
        """Stop processes, close the twin app, delete this test's queues (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            # A worker on RabbitMQ sees SIGTERM only when its event loop next wakes for a timer,
            # seconds later (about 4 s, against 0.2 s on Redis), so a warm shutdown here ran
            # into the SIGKILL after 5 s anyway. RabbitMQ requeues what a killed worker held,
            # and the queues go below. On Redis the warm shutdown puts prefetched tasks back
            # instead of leaving them in the transport's unacked set, and takes about 2 s.
            self.procs.close(timeout=0.0 if self.broker_url.startswith("amqp") else 5.0)
        finally:
            self._close_app()
            delete_queues(self.broker_url, [*self.queues, *self._extra_queues])


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Remember each phase's report on the item, so fixtures can tell whether the test failed."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


HarnessFactory = Callable[[str], Harness]


@pytest.fixture
def harness_factory(
    request: pytest.FixtureRequest,
    migrated_dsn: str,
    conn: psycopg.Connection[Any],
    table: str,
    tmp_path: Path,
) -> Iterator[HarnessFactory]:
    """Build harnesses on any broker URL (for tests that bring their own broker)."""
    create_tables(conn)
    made: list[Harness] = []

    def make(broker_url: str) -> Harness:
        h = Harness(
            broker_url=broker_url, dsn=migrated_dsn, conn=conn, table=table, tmp=tmp_path / str(len(made))
        )
        made.append(h)
        return h

    try:
        yield make
    finally:
        report = getattr(request.node, "rep_call", None)
        for h in made:
            if report is not None and report.failed and h.procs.started:
                print(h.procs.logs())
            h.close()


@pytest.fixture
def harness(broker_url: str, harness_factory: HarnessFactory) -> Harness:
    """A test's outbox app on ``broker_url`` (Redis, and RabbitMQ when reachable) with a fresh
    database; its processes are stopped and its queues deleted after the test."""
    return harness_factory(broker_url)
