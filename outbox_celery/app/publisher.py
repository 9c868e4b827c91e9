"""The claim run's broker side: one Celery delivery task per claimed row (or batch of rows).

:class:`TaskPublisher` is the :class:`~outbox_celery.claim.claimer.Publisher` an
:class:`~outbox_celery.app.outbox.Outbox` hands to its claim runs. It sends the tasks over the
process's own publishing connection, whose socket timeouts (``broker_timeout``) end a publish
that hangs, and with deterministic task ids (``<table>:<id>:v<lease_version>``). It neither
registers tasks nor reads the Celery configuration beyond the broker's address: the
:class:`~outbox_celery.app.outbox.Outbox` gives it its tasks, settings and handlers.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any

from celery import Celery, Task
from celery.exceptions import QueueNotFound

from ..claim.claimer import Published
from ..claim.executor import Claimed
from ..claim.units import publish_units
from ..config import OutboxConfig
from ..handlers import HandlerSpec
from ..tracing import task_headers
from .worker_settings import is_redis

__all__ = ["TaskPublisher"]

# The Outbox's logger: publish failures have always been logged there, and logging configs name it.
logger = logging.getLogger("outbox_celery.app.outbox")


def _reprs(claim: Claimed, database: str | None) -> dict[str, Any]:
    """A delivery task's ``argsrepr``/``kwargsrepr``, given rather than derived by Celery."""
    db = "" if database is None else f", {database!r}"
    return {"argsrepr": f"({claim.id}, {claim.lease_version}{db})", "kwargsrepr": "{}"}


def _batch_reprs(unit: Sequence[Claimed], database: str | None) -> dict[str, Any]:
    """A batch task's ``argsrepr``: its size and id range, not two arrays of up to MAX_BATCH."""
    ids = [c.id for c in unit]
    db = "" if database is None else f", {database!r}"
    return {"argsrepr": f"({len(unit)} rows, ids {min(ids)}..{max(ids)}{db})", "kwargsrepr": "{}"}


@contextmanager
def _publish_batch(producer: Any, n: int) -> Iterator[bool]:
    """One claim batch's publishes sent together where the transport can (kombu >= 5.7).

    On Redis, kombu buffers the batch's ``LPUSH``es in one pipeline, sent when the block exits
    without an error (discarded when it raises): one round trip and one Redis client for the
    batch instead of one of each per task. Other transports publish each task at once. Yields
    whether publishes are buffered.
    """
    batch = getattr(producer, "batch", None)
    if batch is None or not getattr(producer, "supports_batch_publish", False):
        yield False
        return
    # Room for every command of the batch: no automatic flush midway, all or nothing.
    with batch(max_size=max(1000, 4 * n)):
        yield True


class TaskPublisher:
    """Sends an outbox's claimed rows to the broker as delivery tasks.

    A :class:`~outbox_celery.claim.claimer.Publisher`: calling it with a claim batch sends one
    ``deliver`` task per row, or one ``deliver_batch`` task per group of a batch handler's rows
    (:func:`~outbox_celery.claim.units.publish_units`), and returns how many rows were sent.

    :param app: the Celery app whose broker the tasks go to.
    :param config: the outbox's resolved settings (``table``, ``task_time_limit``,
        ``max_clock_skew``, ``broker_timeout``, ``default_queue``).
    :param handlers: the registered handlers by event type, read at each publish (handlers
        registered later are seen).
    :param name: the outbox's name, the prefix of the tasks' names shown in Flower.
    :param deliver: the ``<name>.deliver`` task.
    :param deliver_batch: the ``<name>.deliver_batch`` task.
    """

    def __init__(
        self,
        app: Celery,
        config: OutboxConfig,
        handlers: Mapping[str, HandlerSpec],
        *,
        name: str,
        deliver: Task[Any, Any],
        deliver_batch: Task[Any, Any],
    ) -> None:
        self.app = app
        self.config = config
        self.name = name
        self._handlers = handlers
        self._deliver = deliver
        self._deliver_batch = deliver_batch
        self._lock = threading.Lock()
        # One publish at a time on the process's connection: with several databases, their
        # push listeners publish from a thread each (kombu's connections are not thread-safe).
        self._publishing = threading.Lock()
        self._conn: Any = None
        self._conn_pid: int | None = None

    def queue_for(self, event_type: str) -> str:
        """The queue delivery tasks of ``event_type`` are routed to."""
        spec = self._handlers.get(event_type)
        return (spec.queue if spec and spec.queue else None) or self.config.default_queue

    def task_id(self, claim: Claimed, database: str | None = None) -> str:
        """Deterministic Celery task id of a claimed row: ``<table>:<id>:v<version>``, after
        ``<database>/`` when the outbox serves several."""
        db = "" if database is None else f"{database}/"
        return f"{db}{self.config.table.qualified}:{claim.id}:v{claim.lease_version}"

    def batch_task_id(self, unit: Sequence[Claimed], database: str | None = None) -> str:
        """Deterministic Celery task id of a batch task: its first claim's, then ``+<size>``."""
        return f"{self.task_id(unit[0], database)}+{len(unit)}"

    def __call__(self, claims: Sequence[Claimed], database: str | None = None) -> Published:
        """Send one delivery task per claim (per group, for batch handlers and packs) over one
        connection; never raises.

        A route the app refuses to route (its queue is not declared while
        ``task_create_missing_queues`` is off: Celery's ``QueueNotFound``) is skipped and named
        in :attr:`Published.refused`; the other routes are published. A broker failure stops
        the publish: the claims after it are in neither list. Claims are grouped by
        :func:`~outbox_celery.claim.units.publish_units`; the claim loop orders them that way.
        With several databases, ``database`` names the claims' database in every task.
        """
        with self._publishing:
            return self._publish(claims, database)

    def _publish(self, claims: Sequence[Claimed], database: str | None) -> Published:
        sent: list[Claimed] = []
        refused: dict[str, str] = {}
        skew = timedelta(seconds=self.config.max_clock_skew)
        try:
            with self._producer() as producer:
                queued: list[Claimed] = []
                with _publish_batch(producer, len(claims)) as batched:
                    # Batched, the publish only buffers: nothing to retry there.
                    options = self._options(producer, retry=not batched)
                    for unit in publish_units(claims, self._handlers, max_attempts=self.config.max_attempts):
                        route = unit[0].event_type
                        if route in refused:
                            continue
                        try:
                            self._send(unit, options, skew, database)
                        except QueueNotFound as exc:
                            refused[route] = f"{type(exc).__name__}: {exc}"
                            continue
                        queued += unit
                        if not batched:
                            sent = list(queued)
                # Batched (Redis): nothing left this process before the pipeline ran, at the
                # exit of the batch; a failure there counts none of the batch as sent, so all of
                # its rows are released (any task that did reach the broker then finds its row
                # pending, or claimed under a new lease_version: its fenced start refuses it,
                # DESIGN invariant 4).
                sent = queued
        except Exception as exc:
            logger.error(
                "outbox publish failed after %s of %s task(s): %s",
                len(sent),
                len(claims),
                exc,
                extra={"outcome": "publish_failed"},
            )
        return Published(sent, refused)

    def _options(self, producer: Any, *, retry: bool) -> dict[str, Any]:
        """The ``apply_async`` options every delivery task of one publish shares."""
        # Hard limit below the lease; the soft one lets the handler see SoftTimeLimitExceeded
        # (recorded in last_error) shortly before.
        # Celery takes fractional seconds here (the stubs say int): short leases need them.
        hard_limit = round(self.config.task_time_limit, 3)
        return {
            "time_limit": hard_limit,
            "soft_time_limit": round(max(hard_limit * 0.9, hard_limit - 1.0), 3),
            "producer": producer,
            "retry": retry,
            "retry_policy": {
                "max_retries": 1,
                "interval_start": 0.0,
                "interval_step": 0.2,
                "interval_max": 0.2,
            },
        }

    def _send(
        self, unit: Sequence[Claimed], options: dict[str, Any], skew: timedelta, database: str | None
    ) -> None:
        """Publish the task of one unit (a claim, a batch handler's group or a pack)."""
        c = unit[0]
        # With several databases the task names its database: an argument, and in the name
        # Flower shows.
        where = "" if database is None else f"[{database}]"
        extra = () if database is None else (database,)
        spec = self._handlers.get(c.event_type)
        batch = spec is not None and spec.batch is not None
        if batch or len(unit) > 1:
            # One task for the group (a pack rides on the batch task, invariant 30): its size
            # shows in the task's name.
            task = "deliver_batch" if batch else "deliver"
            self._deliver_batch.apply_async(
                ([u.id for u in unit], [u.lease_version for u in unit], *extra),
                task_id=self.batch_task_id(unit, database),
                queue=self.queue_for(c.event_type),
                expires=min(u.lease_until for u in unit) + skew,
                shadow=f"{self.name}.{task}{where}[{c.event_type}][{len(unit)}]",
                headers=task_headers({"outbox_event_type": c.event_type}),
                **_batch_reprs(unit, database),
                **options,
            )
            return
        self._deliver.apply_async(
            (c.id, c.lease_version, *extra),
            task_id=self.task_id(c, database),
            queue=self.queue_for(c.event_type),
            # The fence decides staleness; ``expires`` only saves work, and since the worker
            # checks it on its own clock it needs the skew allowance.
            expires=c.lease_until + skew,
            shadow=f"{self.name}.deliver{where}[{c.event_type}]",
            headers=task_headers({"outbox_event_type": c.event_type}),
            # Given, not derived: Celery's safe repr of the arguments costs more than the rest
            # of the message body.
            **_reprs(c, database),
            **options,
        )

    @contextmanager
    def _producer(self) -> Iterator[Any]:
        """A producer on this process's own broker connection for claim publishes.

        Its socket timeouts (``broker_timeout``) make a publish that hangs on a half-open
        connection fail, so the claim run releases its rows instead of holding the claim lock
        forever. They apply to this connection only, not to ``broker_transport_options``: there
        they would reach every connection of the app, the workers' consuming ones included,
        whose liveness kombu's own health checks handle. A connection that failed is closed and
        replaced at the next run, never reused.
        """
        pid = os.getpid()
        conn = self._conn
        if conn is None or self._conn_pid != pid:
            timeout = self.config.broker_timeout
            url = str(self.app.conf.broker_write_url or self.app.conf.broker_url or "")
            options: dict[str, Any] = {}
            if is_redis(url):
                options = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
            elif url.startswith(("amqp", "pyamqp")):
                # A publishing connection only: read timeouts cannot starve a consumer here.
                options = {"read_timeout": timeout, "write_timeout": timeout}
            conn = self.app.connection_for_write(connect_timeout=timeout, transport_options=options)
            self._conn, self._conn_pid = conn, pid
        try:
            yield self.app.amqp.Producer(conn, auto_declare=True)
        except BaseException:
            self._conn = None
            with suppress(Exception):
                conn.close()
            raise

    def close(self) -> None:
        """Close this process's publishing connection, if it opened one (idempotent).

        A connection inherited through a fork belongs to the parent and is left alone.
        """
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None and self._conn_pid == os.getpid():
                with suppress(Exception):
                    conn.close()
