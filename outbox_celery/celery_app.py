"""The :class:`Outbox`: binds an outbox table to a Celery app.

It registers three tasks (``<name>.claim``, ``<name>.deliver``, ``<name>.purge``), installs the
claim (and retention) entries in ``beat_schedule``, routes each event type to its queue, opens a
psycopg pool per worker process after fork and closes it at shutdown.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import psycopg
from celery import Celery, signals
from psycopg_pool import ConnectionPool

from .config import OutboxConfig
from .dispatch import ClaimRun, Dispatcher, Handler, HandlerSpec, Outcome, default_owner
from .errors import ConfigurationError
from .store import Claimed, Store

__all__ = ["Outbox"]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Handler)

# Pools inherited across fork() are never touched (closing them would talk on the parent's
# sockets) nor garbage collected (their finalizer would wait on threads that did not survive).
_ORPHANED_POOLS: list[ConnectionPool[Any]] = []


class Outbox:
    """An outbox table delivered through a Celery app.

    ::

        app = Celery("proj", broker="redis://localhost:6379/0")
        outbox = Outbox(app, dsn="postgresql://...", lease=timedelta(seconds=60))

        @outbox.handler("order.created", queue="orders")
        def deliver_order_created(message: Message) -> None:
            post_webhook(message.payload, idempotency_key=message.idempotency_key)

    :param app: the Celery app.
    :param name: prefix of the task names and beat entries (``outbox.claim``...). Use a distinct
        one per outbox when one app serves several tables.
    :param settings: any :class:`~outbox_celery.config.OutboxConfig` field (``dsn``, ``table``,
        ``lease``, ``batch_size``, ``max_attempts``, ``claim_interval``...). Unset fields come
        from the Celery configuration (``outbox_<field>``), then from the defaults.
    """

    def __init__(self, app: Celery, *, name: str = "outbox", **settings: Any) -> None:
        unknown = set(settings) - set(OutboxConfig.__dataclass_fields__)
        if unknown:
            raise ConfigurationError(f"unknown outbox setting(s): {', '.join(sorted(unknown))}")
        self.app = app
        self.name = name
        self._settings = settings
        self._config: OutboxConfig | None = None
        self._handlers: dict[str, HandlerSpec] = {}
        self._lock = threading.Lock()
        self._pool: ConnectionPool[Any] | None = None
        self._pool_pid: int | None = None
        self._dispatcher: Dispatcher | None = None
        self._register_tasks()
        self._connect_signals()
        if getattr(app, "configured", False):
            self._configure_app()
        else:
            app.on_after_configure.connect(self._on_after_configure, weak=False)

    # -- configuration -------------------------------------------------------------------------

    @property
    def config(self) -> OutboxConfig:
        """The resolved settings (keyword arguments > Celery ``outbox_*`` > defaults)."""
        if self._config is None:
            self._config = OutboxConfig.from_mapping(self.app.conf, **self._settings)
        return self._config

    @property
    def store(self) -> Store:
        """The SQL layer bound to this outbox's table."""
        return self.dispatcher.store

    @property
    def dispatcher(self) -> Dispatcher:
        """Claim/deliver logic bound to this process's pool."""
        if self._dispatcher is None:
            self._dispatcher = Dispatcher(self.config, self.connection, self._handlers)
        return self._dispatcher

    @property
    def handlers(self) -> dict[str, HandlerSpec]:
        """Registered handlers by event type."""
        return dict(self._handlers)

    def handler(self, event_type: str, *, queue: str | None = None) -> Callable[[F], F]:
        """Register the function that delivers ``event_type`` (one per event type).

        The handler receives a :class:`~outbox_celery.message.Message` and runs outside any
        database transaction. It raises :class:`~outbox_celery.errors.RetryableError`,
        :class:`~outbox_celery.errors.PermanentError` or :class:`~outbox_celery.errors.Defer` to
        say what happened; returning normally means delivered.

        :param queue: the Celery queue its delivery tasks go to (default: ``default_queue``).
        """
        if not isinstance(event_type, str) or not event_type:
            raise ConfigurationError("event_type must be a non-empty string")

        def register(fn: F) -> F:
            if event_type in self._handlers:
                raise ConfigurationError(f"a handler for {event_type!r} is already registered")
            self._handlers[event_type] = HandlerSpec(event_type, fn, queue or "")
            return fn

        return register

    def queue_for(self, event_type: str) -> str:
        """The queue delivery tasks of ``event_type`` are routed to."""
        spec = self._handlers.get(event_type)
        return (spec.queue if spec and spec.queue else None) or self.config.default_queue

    @property
    def queues(self) -> list[str]:
        """Every queue this outbox publishes to (claim queue first)."""
        names = [self.config.claim_queue, self.config.default_queue]
        names += [s.queue for s in self._handlers.values() if s.queue]
        return list(dict.fromkeys(names))

    def _on_after_configure(self, sender: Any = None, **kwargs: Any) -> None:
        self._configure_app()

    def _configure_app(self) -> None:
        cfg = self.config
        conf = self.app.conf
        schedule = dict(conf.beat_schedule or {})
        schedule.setdefault(
            f"{self.name}-claim",
            {
                "task": self.claim_task.name,
                "schedule": cfg.claim_interval,
                # A stalled beat or worker must not pile claims up: each expires after one tick.
                "options": {"queue": cfg.claim_queue, "expires": cfg.claim_interval},
            },
        )
        if cfg.retention is not None:
            schedule.setdefault(
                f"{self.name}-purge",
                {
                    "task": self.purge_task.name,
                    "schedule": min(600.0, max(60.0, cfg.retention / 10)),
                    "options": {"queue": cfg.claim_queue, "expires": 60.0},
                },
            )
        conf.beat_schedule = schedule
        if not cfg.configure_celery:
            return
        changes: dict[str, Any] = conf.changes or {}
        if "worker_prefetch_multiplier" not in changes:
            # Reserved-but-unstarted deliveries sit in a worker while their lease runs.
            conf.worker_prefetch_multiplier = 1
        if str(conf.broker_url or "").startswith(("redis", "rediss")):
            options = dict(conf.broker_transport_options or {})
            if "visibility_timeout" not in options:
                # Redis redelivers unacked (acks_late) messages after this; it must exceed the lease.
                options["visibility_timeout"] = max(3600.0, cfg.lease * 4)
                conf.broker_transport_options = options

    def check_worker_settings(self) -> list[str]:
        """Return warnings for Celery settings that work against the outbox (and log them)."""
        cfg = self.config
        conf = self.app.conf
        problems = []
        if (conf.worker_prefetch_multiplier or 0) > 4:
            problems.append(
                f"worker_prefetch_multiplier={conf.worker_prefetch_multiplier}: reserved deliveries "
                "wait in the worker while their lease runs; use 1"
            )
        if str(conf.broker_url or "").startswith(("redis", "rediss")):
            vt = (conf.broker_transport_options or {}).get("visibility_timeout", 3600)
            if vt <= cfg.lease:
                problems.append(
                    f"broker visibility_timeout={vt}s is not above the lease ({cfg.lease}s): Redis "
                    "would redeliver tasks that are still running"
                )
        if conf.task_time_limit and conf.task_time_limit >= cfg.lease:
            problems.append(
                f"task_time_limit={conf.task_time_limit}s is not below the lease ({cfg.lease}s); "
                "outbox deliveries use their own limit below the lease"
            )
        for p in problems:
            logger.warning("outbox settings: %s", p)
        return problems

    # -- connections ---------------------------------------------------------------------------

    @property
    def pool(self) -> ConnectionPool[Any]:
        """This process's connection pool (opened lazily, again after a fork)."""
        pid = os.getpid()
        if self._pool is None or self._pool_pid != pid:
            with self._lock:
                if self._pool is None or self._pool_pid != pid:
                    if self._pool is not None:
                        _ORPHANED_POOLS.append(self._pool)
                    dsn = self.config.dsn
                    if not dsn:
                        raise ConfigurationError(
                            "no DSN: pass Outbox(app, dsn=...) or set outbox_dsn in the Celery config"
                        )
                    self._pool = ConnectionPool(
                        dsn,
                        min_size=1,
                        max_size=self.config.pool_max_size,
                        kwargs={"autocommit": True, "application_name": f"outbox-celery:{self.name}"},
                        name=f"outbox-{self.name}",
                        open=True,
                    )
                    self._pool_pid = pid
        return self._pool

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled autocommit connection."""
        with self.pool.connection() as conn:
            yield conn

    def close(self) -> None:
        """Close this process's pool (idempotent)."""
        with self._lock:
            pool, self._pool = self._pool, None
            if pool is not None and self._pool_pid == os.getpid():
                pool.close()
            self._pool_pid = None

    def _after_fork(self, **kwargs: Any) -> None:
        with self._lock:
            if self._pool is not None and self._pool_pid != os.getpid():
                _ORPHANED_POOLS.append(self._pool)
                self._pool = None
                self._pool_pid = None

    def _on_shutdown(self, **kwargs: Any) -> None:
        self.close()

    def _on_worker_init(self, **kwargs: Any) -> None:
        self.check_worker_settings()

    def _connect_signals(self) -> None:
        signals.worker_process_init.connect(self._after_fork, weak=False)
        signals.worker_process_shutdown.connect(self._on_shutdown, weak=False)
        signals.worker_shutdown.connect(self._on_shutdown, weak=False)
        signals.worker_init.connect(self._on_worker_init, weak=False)
        os.register_at_fork(after_in_child=self._after_fork)

    # -- tasks ---------------------------------------------------------------------------------

    def _register_tasks(self) -> None:
        outbox = self

        @self.app.task(name=f"{self.name}.claim", ignore_result=True, acks_late=False)
        def claim() -> dict[str, Any]:
            """Reap, claim and publish (triggered by beat every ``claim_interval``)."""
            return outbox.claim().as_dict()

        @self.app.task(
            name=f"{self.name}.deliver",
            ignore_result=True,
            acks_late=True,
            # A lost worker acks its message: the row comes back through its lease, fenced.
            reject_on_worker_lost=False,
            max_retries=0,
        )
        def deliver(outbox_id: int, lease_version: int) -> str:
            """Deliver one outbox row (fenced start, handler, fenced finalize)."""
            return outbox.dispatcher.deliver(int(outbox_id), int(lease_version))

        @self.app.task(name=f"{self.name}.purge", ignore_result=True)
        def purge() -> int:
            """Delete ``done`` rows older than ``retention`` in bounded batches."""
            return outbox.purge()

        self.claim_task = claim
        self.deliver_task = deliver
        self.purge_task = purge

    def task_id(self, claim: Claimed) -> str:
        """Deterministic Celery task id of a claimed row: ``<table>:<id>:v<version>``."""
        return f"{self.config.table.qualified}:{claim.id}:v{claim.lease_version}"

    def publish(self, claims: Sequence[Claimed]) -> int:
        """Send one delivery task per claim over a single producer connection.

        Returns how many were sent (stops at the first failure).
        """
        cfg = self.config
        sent = 0
        retry_policy = {
            "max_retries": 1,
            "interval_start": 0.0,
            "interval_step": 0.2,
            "interval_max": 0.2,
        }
        try:
            with self.app.producer_or_acquire() as producer:
                for c in claims:
                    self.deliver_task.apply_async(
                        (c.id, c.lease_version),
                        task_id=self.task_id(c),
                        queue=self.queue_for(c.event_type),
                        expires=c.lease_until,
                        time_limit=int(cfg.task_time_limit),
                        soft_time_limit=max(1, int(cfg.task_time_limit) - 1),
                        shadow=f"{self.name}.deliver[{c.event_type}]",
                        headers={"outbox_event_type": c.event_type},
                        producer=producer,
                        retry=True,
                        retry_policy=retry_policy,
                    )
                    sent += 1
        except Exception as exc:
            logger.error(
                "outbox publish failed after %s of %s task(s): %s",
                sent,
                len(claims),
                exc,
                extra={"outcome": "publish_failed"},
            )
        return sent

    def claim(self) -> ClaimRun:
        """Run one claim (what the beat-triggered task does); usable without Celery workers."""
        return self.dispatcher.claim_and_publish(self.publish, owner=default_owner())

    def deliver(self, outbox_id: int, lease_version: int) -> str:
        """Deliver one row in this process (what the delivery task does)."""
        return self.dispatcher.deliver(outbox_id, lease_version)

    def purge(self) -> int:
        """Delete old ``done`` rows per ``retention``; returns rows deleted."""
        cfg = self.config
        if cfg.retention is None:
            return 0
        from .admin import purge_done

        with self.connection() as conn:
            return purge_done(conn, cfg.table, older_than=cfg.retention, batch_size=cfg.retention_batch_size)


__all__ += ["Outcome"]
