"""The :class:`Outbox`: binds an outbox table to a Celery app.

It registers its tasks (:mod:`outbox_celery.app.tasks`), installs the claim (and retention) entries
in ``beat_schedule`` (:mod:`outbox_celery.app.celery_config`), routes each event type to its queue
(handlers: :mod:`outbox_celery.handlers`), opens a psycopg pool per worker process after fork
and closes it at shutdown (:mod:`outbox_celery.app.signals`). Its settings are the fields of
:class:`~outbox_celery.config.OutboxConfig`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

import psycopg
from celery import Celery
from psycopg_pool import ConnectionPool

from ..backoff import RetryPolicy
from ..claim.claimer import Claimer, ClaimRun, Published, default_owner
from ..claim.executor import Claimed
from ..claim.listener import Listener
from ..config import OutboxConfig, given_settings, resolve
from ..databases import Database
from ..db import migrations
from ..db.pool import ForkSafePool, IdleCheck
from ..db.store import Store
from ..dsn import DSN_ENV, error_line
from ..errors import ConfigurationError, UnknownDatabase
from ..handlers import MAX_BATCH, MAX_WAIT, HandlerSpec, register_handler
from ..message import Outcome, split_route
from ..operated import OperatedOutbox
from ..ops import flow, retention, subscriptions
from ..produce import enqueue as producer
from ..produce.enqueue import Event
from ..worker.deliverer import Deliverer, tally
from .celery_config import configure_app, dsn_exposed, loaded_conf
from .lanes import POOL_CHECK_IDLE, Lane, Lanes, connect_timeout, open_pool
from .publisher import TaskPublisher
from .push import install_listener_step
from .quiet_logs import quiet_claim_logs
from .signals import connect_worker_signals
from .tasks import CoalescedClaims, register_tasks
from .worker_settings import check_worker_settings

logger = logging.getLogger(__name__)

__all__ = ["MAX_BATCH", "MAX_WAIT", "Outbox"]

F = TypeVar("F", bound=Callable[..., Any])


# Retention: at most this many batches of ``retention_batch_size`` per beat-triggered run.
PURGE_MAX_BATCHES_PER_RUN = 20


class Outbox(OperatedOutbox):
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
    :param config: a whole :class:`~outbox_celery.config.OutboxConfig`. Without it, a setting
        not given as a keyword comes from the Celery configuration (``outbox_<name>``), then
        from its default; with it, from ``config``, and the Celery configuration may hold no
        ``outbox_*`` setting (:func:`~outbox_celery.config.resolve`).
    :param settings: keywords named after the fields of
        :class:`~outbox_celery.config.OutboxConfig` (``dsn``, ``table``, ``lease``...; meanings
        and defaults there and in docs/celery.md); they win over ``config`` and the Celery
        configuration. An unknown name raises :class:`~outbox_celery.errors.ConfigurationError`
        naming the closest settings.
    :param store: the :class:`~outbox_celery.db.store.Store` the claimer and the deliverer run their queries
        through (default: one bound to ``table`` with ``relaxed_commit``).
    :param retry: a :data:`~outbox_celery.backoff.RetryPolicy`, ``(attempt, error) -> seconds``,
        deciding the wait after a :class:`~outbox_celery.errors.RetryableError` that carries no
        ``delay`` (default: full-jitter :class:`~outbox_celery.backoff.Backoff` from
        ``backoff_base`` and ``backoff_cap``).
    """

    def __init__(
        self,
        app: Celery,
        *,
        name: str = "outbox",
        config: OutboxConfig | None = None,
        store: Store | None = None,
        retry: RetryPolicy | None = None,
        **settings: Any,
    ) -> None:
        if config is not None and not isinstance(config, OutboxConfig):
            raise ConfigurationError(f"config must be an OutboxConfig, got {type(config).__name__}")
        # Only the settings the caller gave: the others come from config or the Celery configuration.
        self._settings = given_settings(settings)
        self._base = config
        self._store = store
        self._retry = retry
        self.app = app
        self.name = name
        self._config: OutboxConfig | None = None
        self._handlers: dict[str, HandlerSpec] = {}
        self._pool = ForkSafePool(self._open_pool)
        self._idle_check = IdleCheck(POOL_CHECK_IDLE)
        self._claimer: Claimer | None = None
        self._deliverer: Deliverer | None = None
        self._publisher: TaskPublisher | None = None
        self._lanes: Lanes | None = None
        #: The push listener running in this worker process, if any (docs/push.md); with
        #: several databases, one per database in :attr:`listeners`.
        self.listener: Listener | None = None
        #: The push listeners of this worker process by database (``databases=``).
        self.listeners: dict[str, Listener] = {}
        # Through a lambda, not the bound method: a wrapper set on the instance's ``claim``
        # (or ``publish``) sees the claim task's runs.
        self._claim_task_body = CoalescedClaims(lambda: self.claim(), lambda: self.config.claim_interval)
        tasks = register_tasks(self, self._claim_task_body)
        self.claim_task, self.deliver_task, self.deliver_batch_task, self.purge_task = tasks
        quiet_claim_logs(f"{name}.claim")  # the name, not the task: reading it would load the config
        connect_worker_signals(
            app,
            after_fork=self._after_fork,
            shutdown=self.close,
            check=self.check_worker_settings,
            start=self.start_worker,
            shutting_down=self._shutting_down,
        )
        install_listener_step(self)
        if getattr(app, "configured", False):
            self._configure_app()
        else:
            # Not on_after_configure: Celery's signals swallow a receiver's exceptions, so a bad
            # setting would leave beat without a claim entry. Pending defaults run inside the
            # configuration load and their errors reach whoever loads it (worker, beat, caller).
            app.add_defaults(self._configure_hook)

    # -- configuration -------------------------------------------------------------------------

    @property
    def config(self) -> OutboxConfig:
        """The resolved settings (keywords > ``config`` or Celery ``outbox_*`` > defaults)."""
        if self._config is None:
            self._config = resolve(loaded_conf(self.app), self._settings, self._base)
        return self._config

    @property
    def store(self) -> Store:
        """The SQL layer bound to this outbox's table (one per process, shared by the claimer and
        the deliverer)."""
        if self._store is None:
            self._store = Store(self.config.table, relaxed_commit=self.config.relaxed_commit)
        return self._store

    @property
    def lanes(self) -> Lanes | None:
        """This process's databases when the outbox serves several (``databases=``), else ``None``."""
        if self._lanes is None and self.config.databases is not None:
            self._lanes = Lanes(
                self.config.databases, self.config, self._handlers, outbox_name=self.name, retry=self._retry
            )
        return self._lanes

    @property
    def databases(self) -> dict[str, Database]:
        """The databases this outbox serves, by name (``databases=``); empty with one ``dsn``."""
        lanes = self.lanes
        return {} if lanes is None else lanes.databases

    def database(self, name: str) -> Lane:
        """Database ``name`` in this process: its settings, store, pool, claimer and deliverer.

        :raises UnknownDatabase: the outbox serves no database of that name (or only ``dsn``).
        """
        lanes = self.lanes
        if lanes is None:
            raise UnknownDatabase(f"outbox {self.name} serves one database (dsn), not several: no {name!r}")
        return lanes.get(name)

    def deliverer_for(self, database: str | None) -> Deliverer:
        """The deliverer of a delivery task that names ``database`` (``None``: the one ``dsn``).

        :raises UnknownDatabase: the name is not served here, or missing where the outbox
            serves several; the task's row was not started and comes back after its lease
            with no attempt spent (DESIGN invariant 34).
        """
        if database is None:
            if self.lanes is not None:
                raise UnknownDatabase(f"outbox {self.name} serves several databases and the task names none")
            return self.deliverer
        return self.database(database).deliverer

    @property
    def claimer(self) -> Claimer:
        """Claim runs bound to this process's pool (what the claim task and push run)."""
        if self._claimer is None:
            self._claimer = Claimer(self.config, self.connection, self._handlers, store=self.store)
        return self._claimer

    @property
    def deliverer(self) -> Deliverer:
        """Delivery tasks bound to this process's pool (what the delivery tasks run)."""
        if self._deliverer is None:
            self._deliverer = Deliverer(
                self.config,
                self.connection,
                self._handlers,
                store=self.store,
                retry=self._retry,
                recover=self._check_pool,
            )
        return self._deliverer

    @property
    def handlers(self) -> dict[str, HandlerSpec]:
        """Registered handlers by route: the event type, or ``<event_type>@<name>`` for a
        subscription (DESIGN invariant 28)."""
        return dict(self._handlers)

    def handler(
        self,
        event_type: str,
        *,
        name: str | None = None,
        queue: str | None = None,
        transactional: bool | str = False,
        session_factory: Callable[[], Any] | None = None,
        using: str | None = None,
        batch: int | None = None,
        max_wait: float | timedelta | None = None,
        pack: int | None = None,
        concurrency: int | None = None,
        rate: str | float | None = None,
        key_concurrency: int | None = None,
        key_rate: str | float | None = None,
    ) -> Callable[[F], F]:
        """Register the function that delivers ``event_type`` (one per event type), or its
        subscription ``name`` (one per name: each receives every event of the type, with its own
        delivery state, queue and options; docs/subscriptions.md, DESIGN invariant 28).

        The handler receives a :class:`~outbox_celery.message.Message` and runs outside any
        database transaction. It raises :class:`~outbox_celery.errors.RetryableError`,
        :class:`~outbox_celery.errors.PermanentError` or :class:`~outbox_celery.errors.Defer` to
        say what happened; returning normally means delivered. ``transactional`` runs it in the
        transaction of its fenced ``done`` (docs/transactional.md), ``batch`` and ``max_wait``
        give it lists of messages, ``pack`` lets one task carry several (docs/batch.md),
        ``concurrency``, ``rate``, ``key_concurrency`` and ``key_rate`` bound its deliveries
        (docs/flow-control.md). Every option is described, and checked at once, by
        :func:`outbox_celery.handlers.register_handler`; a bad one raises
        :class:`~outbox_celery.errors.ConfigurationError` here.
        """
        return register_handler(
            self._handlers,
            event_type,
            name=name,
            queue=queue,
            transactional=transactional,
            session_factory=session_factory,
            using=using,
            batch=batch,
            max_wait=max_wait,
            pack=pack,
            concurrency=concurrency,
            rate=rate,
            key_concurrency=key_concurrency,
            key_rate=key_rate,
        )

    def queue_for(self, event_type: str) -> str:
        """The queue delivery tasks of ``event_type`` are routed to (the publisher's rule)."""
        return self.publisher.queue_for(event_type)

    @property
    def delivery_queues(self) -> list[str]:
        """Every queue delivery tasks are routed to (default queue first)."""
        names = [self.config.default_queue] + [s.queue for s in self._handlers.values() if s.queue]
        return list(dict.fromkeys(names))

    @property
    def queues(self) -> list[str]:
        """Every queue this outbox publishes to (claim queue first)."""
        return list(dict.fromkeys([self.config.claim_queue, *self.delivery_queues]))

    def _configure_hook(self) -> dict[str, Any]:
        self._configure_app()
        return {}

    def _configure_app(self) -> None:
        configure_app(self.app, self.config, name=self.name, claim_task=self.claim_task)

    def check_worker_settings(
        self,
        *,
        pool: str | None = None,
        concurrency: int | None = None,
        queues: Collection[str] | None = None,
    ) -> list[str]:
        """Return warnings for Celery settings that work against the outbox (and log them).

        Run by every worker at start-up (``worker_init``) with its pool, concurrency and queues;
        the checks are :func:`outbox_celery.app.worker_settings.check_worker_settings`.

        :param pool: the worker's pool (``prefork``, ``solo``, ``threads``, ``gevent``...).
        :param concurrency: the worker's concurrency.
        :param queues: the queues the worker consumes; the pool checks only concern workers that
            consume a delivery queue (not, say, a solo worker on the claim queue alone).
        """
        return check_worker_settings(
            self.config,
            self.app.conf,
            delivery_queues=self.delivery_queues,
            dsn_exposed=dsn_exposed(self.config, self.app.conf, given=self._settings),
            pool=pool,
            concurrency=concurrency,
            queues=queues,
        )

    def register_subscriptions(self) -> list[str]:
        """Add the subscriptions this outbox's handlers declare (``name=``) to its table, where
        the producers read them (DESIGN invariant 28); returns the routes added (an existing one
        is left as it is). Every worker runs it at start-up (:meth:`start_worker`); one removed
        by an operator stays removed (logged). With several databases, in each of them."""
        added: list[str] = []
        for cfg in self._database_configs():
            with self._start_connection(cfg) as conn:
                added += subscriptions.register(conn, cfg.table, self._handlers)
        return list(dict.fromkeys(added))

    def _database_configs(self) -> list[OutboxConfig]:
        """The settings of each database served: the outbox's own, or one per ``databases``."""
        lanes = self.lanes
        return [self.config] if lanes is None else [lane.config for lane in lanes.lanes()]

    def _start_connection(self, config: OutboxConfig | None = None) -> psycopg.Connection[Any]:
        # A connection of its own, not the pool: at worker_init the pool processes are not
        # forked yet, and the parent keeps no connection it does not use.
        cfg = config or self.config
        return psycopg.connect(
            cfg.dsn or "",
            autocommit=True,
            application_name=f"outbox-celery:{self.name}:start",
            **connect_timeout(cfg),
        )

    def start_worker(self, queues: Collection[str] | None = None) -> None:
        """What a worker of this app does at start-up when it serves this outbox (it consumes
        its claim queue or a delivery queue; ``queues`` unknown: it does).

        The database must be reachable, the table migrated and the handlers' subscriptions
        registered; each is tried again with a backoff for ``wait_for_database`` seconds. Past
        that the worker does not start: :class:`SystemExit` with one line that says why (exit
        code 1), rather than a worker that takes tasks it can only fail.
        """
        if queues is not None and not set(queues) & set(self.queues):
            return
        deadline = time.monotonic() + self.config.wait_for_database
        pause = 0.5
        while True:
            try:
                self._ready_to_serve()
                return
            except (psycopg.Error, ConfigurationError) as exc:
                why = error_line(exc, self.config.dsn) if isinstance(exc, psycopg.Error) else str(exc)
            if time.monotonic() + pause > deadline:
                waited = f" after {self.config.wait_for_database:g}s" if self.config.wait_for_database else ""
                raise SystemExit(
                    f"outbox {self.name}: the worker does not start{waited}: {why} "
                    "(set outbox_wait_for_database to wait for the database at start)"
                )
            logger.warning("outbox %s: waiting for the database before starting (%s)", self.name, why)
            time.sleep(pause)
            pause = min(5.0, pause * 2)

    def _shutting_down(self, how: str) -> None:
        """Say what a worker's shutdown waits for: its running deliveries, up to their time limit."""
        from celery.worker import state

        names = {self.deliver_task.name, self.deliver_batch_task.name}
        # type, not name: a delivery task's name is its shadow, outbox.deliver[<route>].
        running = [r for r in list(state.active_requests) if getattr(r, "type", None) in names]
        if how.lower() != "warm" or not running:
            return
        logger.warning(
            "outbox %s: warm shutdown waits for %s running delivery task(s), %.0fs at most (their "
            "time limit); a second Ctrl-C stops at once and their rows come back after their lease",
            self.name,
            len(running),
            self.config.task_time_limit,
            extra={"outcome": "shutdown", "running": len(running)},
        )

    def _ready_to_serve(self) -> None:
        """One try of :meth:`start_worker`: the table migrated, the subscriptions registered.

        With several databases, the worker starts once one of them is ready: the others are
        logged, and their rows wait until they are (DESIGN invariant 34).
        """
        lanes = self.lanes
        if lanes is None:
            self._database_ready(self.config)
            return
        ready, why = 0, ""
        for lane in lanes.lanes():
            try:
                self._database_ready(lane.config)
                ready += 1
            except (psycopg.Error, ConfigurationError) as exc:
                why = error_line(exc, lane.config.dsn) if isinstance(exc, psycopg.Error) else str(exc)
                logger.warning(
                    "outbox %s: database %s is not ready (%s); its rows wait until it is",
                    self.name,
                    lane.name,
                    why,
                    extra={"outcome": "database_failed", "database": lane.name},
                )
        if not ready:
            raise ConfigurationError(f"none of the {len(lanes.lanes())} databases is ready (last: {why})")

    def _database_ready(self, cfg: OutboxConfig) -> None:
        table = cfg.table
        with self._start_connection(cfg) as conn:
            if not migrations.applied_versions(conn, table):
                raise ConfigurationError(f"table {table} was never migrated: run `outbox-celery migrate`")
            todo = migrations.pending(conn, table)
            if todo:
                names = ", ".join(f"{m.version:04d}_{m.name}" for m in todo)
                raise ConfigurationError(
                    f"table {table} is behind: pending {names} (run `outbox-celery migrate`)"
                )
            if any(split_route(r)[1] for r in self._handlers):
                for r in subscriptions.register(conn, table, self._handlers):
                    logger.info("outbox %s: subscription %s added", self.name, r)

    # -- connections ---------------------------------------------------------------------------

    @property
    def pool(self) -> ConnectionPool[Any]:
        """This process's connection pool (opened lazily, again after a fork)."""
        return self._pool.get()

    def _open_pool(self) -> ConnectionPool[Any]:
        if self.config.databases is not None:
            raise ConfigurationError(
                f"outbox {self.name} serves several databases: name one "
                "(outbox.connection(database=...), outbox.database(name).pool)"
            )
        # No local holds the DSN: error reporters that record frame locals would send it.
        if not self.config.dsn:
            raise ConfigurationError(
                f"no DSN: set {DSN_ENV}, pass Outbox(app, dsn=...) or set outbox_dsn in the Celery config"
            )
        return open_pool(self.config, name=self.name, check=self._idle_check)

    @contextmanager
    def connection(self, database: str | None = None) -> Iterator[psycopg.Connection[Any]]:
        """A pooled autocommit connection (with several databases: to ``database``)."""
        if database is not None or self.config.databases is not None:
            with self.database(database or "").connection() as conn:
                yield conn
            return
        with self.pool.connection() as conn:
            try:
                yield conn
            finally:
                self._idle_check.returned(conn)

    def _check_pool(self) -> None:
        """Before a write is retried after a broken connection: test every idle one.

        A server restart or ``pg_terminate_backend`` breaks them all at once; the retry must
        not draw another broken one (psycopg_pool replaces those it finds in the background).
        """
        self.pool.check()

    def _after_fork(self) -> None:
        self._pool.after_fork()
        if self._lanes is not None:
            self._lanes.after_fork()

    def close(self) -> None:
        """Write the batched ``done`` still held, then close this process's pools and publishing
        connection (idempotent)."""
        if self._deliverer is not None:
            self._deliverer.flush()
        self._pool.close()
        if self._lanes is not None:
            self._lanes.close()
        if self._publisher is not None:
            self._publisher.close()

    # -- tasks ---------------------------------------------------------------------------------

    @property
    def publisher(self) -> TaskPublisher:
        """Sends this process's claimed rows to the broker: the claim run's
        :class:`~outbox_celery.claim.claimer.Publisher`, created at first use."""
        if self._publisher is None:
            self._publisher = TaskPublisher(
                self.app,
                self.config,
                self._handlers,
                name=self.name,
                deliver=self.deliver_task,
                deliver_batch=self.deliver_batch_task,
            )
        return self._publisher

    def task_id(self, claim: Claimed, database: str | None = None) -> str:
        """Deterministic Celery task id of a claimed row: ``<table>:<id>:v<version>``, after
        ``<database>/`` with several databases
        (:meth:`TaskPublisher.task_id <outbox_celery.app.publisher.TaskPublisher.task_id>`)."""
        return self.publisher.task_id(claim, database)

    def batch_task_id(self, unit: Sequence[Claimed], database: str | None = None) -> str:
        """Deterministic Celery task id of a batch or pack task: its first claim's, then ``+<size>``
        (:meth:`~outbox_celery.app.publisher.TaskPublisher.batch_task_id`)."""
        return self.publisher.batch_task_id(unit, database)

    def publish(self, claims: Sequence[Claimed], database: str | None = None) -> Published:
        """Send one delivery task per claim (per group, for batch handlers and packs); what was
        sent and which routes the app refused. The tasks name ``database`` when the outbox
        serves several. Delegates to :attr:`publisher`
        (:class:`~outbox_celery.app.publisher.TaskPublisher`).
        """
        return self.publisher(claims, database=database)

    def claim(self) -> ClaimRun:
        """Run one claim (what the beat-triggered task does); usable without Celery workers.

        With several databases, one claim run on each that may have work, in turn
        (:meth:`Lanes.claim <outbox_celery.app.lanes.Lanes.claim>`, DESIGN invariant 34).
        """
        # Through the method, not the publisher itself: a wrapper set on the instance's
        # ``publish`` (benchmarks/hooks.py times publishes so) sees every claim run's publishes.
        lanes = self.lanes
        if lanes is not None:
            return lanes.claim(self.publish, owner=default_owner(), sweep_idle=self.config.listen)
        return self.claimer.run(self.publish, owner=default_owner())

    def claim_database(self, database: str) -> ClaimRun:
        """One claim run on ``database`` alone (what its push listener runs)."""
        lanes = self.lanes
        if lanes is None:
            raise UnknownDatabase(f"outbox {self.name} serves one database (dsn), not several")
        return lanes.claim_one(lanes.get(database), self.publish, owner=default_owner())

    def enqueue(self, conn: Any, *, database: str | None = None, **event: Any) -> int:
        """:func:`~outbox_celery.enqueue` into this outbox's ``table``, within ``max_payload_bytes``.

        ``event`` takes :func:`~outbox_celery.enqueue`'s keywords (``event_type``, ``payload``,
        ``aggregate_type``, ``aggregate_id``, ...); ``conn`` is any connection it accepts. With
        several databases, ``conn`` is one to ``database``, whose table is written; ``database``
        may be left out only while every database uses the Outbox's ``table``.

        :raises ConfigurationError: as explained for ``database`` above.
        """
        return producer.enqueue(conn, **self._producer_defaults(event, database))

    def enqueue_many(
        self,
        conn: Any,
        messages: Iterable[Event | Mapping[str, Any]],
        *,
        database: str | None = None,
        **options: Any,
    ) -> list[int]:
        """:func:`~outbox_celery.enqueue_many` with this outbox's ``table`` and
        ``max_payload_bytes`` (with several databases, ``database``'s table)."""
        return producer.enqueue_many(conn, messages, **self._producer_defaults(options, database))

    def _producer_defaults(self, options: dict[str, Any], database: str | None = None) -> dict[str, Any]:
        """``table`` and ``max_payload_bytes`` for a producer call.

        :raises ConfigurationError: with several databases, no ``database`` named while some
            database has a table of its own (a schema per tenant): the Outbox's ``table`` is not
            theirs, and a row written there would be claimed by nobody.
        """
        if database is not None:
            table = self.database(database).config.table
        else:
            table = self.config.table
            lanes = self.lanes
            if lanes is not None and "table" not in options:
                own = [lane.name for lane in lanes.lanes() if lane.config.table != table]
                if own:
                    raise ConfigurationError(
                        f"outbox {self.name} serves several databases and {', '.join(own)} have "
                        f"tables of their own, not {table.qualified}: name one with database="
                    )
        return {"table": table, "max_payload_bytes": self.config.max_payload_bytes, **options}

    def _each_database(self, database: str | None) -> list[tuple[str | None, OutboxConfig]]:
        """``(name, settings)`` of ``database``, or of every database served when ``None``."""
        lanes = self.lanes
        if lanes is None or database is not None:
            return [(database, self.config if database is None else self.database(database).config)]
        return [(lane.name, lane.config) for lane in lanes.lanes()]

    def pause(self, event_type: str, *, limit_key: str | None = None, database: str | None = None) -> bool:
        """Pause ``event_type`` (or only its ``limit_key``) in this outbox's table: no claim
        hands out its messages until :meth:`resume` (docs/flow-control.md, DESIGN invariants 23,
        24). Deliveries already running finish. A type with subscriptions is paused with every
        route of it (DESIGN invariant 28); a route alone pauses that subscription. Returns
        whether it was running before (``False``: already paused). With several databases, in
        ``database``, or in every one when ``None``.
        """
        was = False
        for name, cfg in self._each_database(database):
            with self.connection(name) as conn:
                was = flow.pause(conn, cfg.table, event_type, limit_key=limit_key) or was
        return was

    def resume(self, event_type: str, *, limit_key: str | None = None, database: str | None = None) -> bool:
        """Resume ``event_type`` (or only its ``limit_key``): it is claimable at once (the push
        listeners are woken), and a RateLimited hold on it ends too; a type with subscriptions
        is resumed with every route of it. Returns whether it was paused or held. With several
        databases, in ``database``, or in every one when ``None``.
        """
        was = False
        for name, cfg in self._each_database(database):
            with self.connection(name) as conn:
                was = flow.resume(conn, cfg.table, event_type, limit_key=limit_key) or was
        return was

    def deliver(self, outbox_id: int, lease_version: int, database: str | None = None) -> Outcome:
        """Deliver one row in this process (what the delivery task does)."""
        return self.deliverer_for(database).deliver([(outbox_id, lease_version)])[outbox_id]

    def deliver_batch(self, pairs: Sequence[tuple[int, int]], database: str | None = None) -> dict[str, int]:
        """Deliver ``(id, lease_version)`` pairs of a batch handler, or a pack, in this process
        (what the batch task does); returns how many rows ended in each outcome (docs/batch.md)."""
        return tally(self.deliverer_for(database).deliver(pairs, batch_done=True))

    def purge(self) -> int:
        """Delete old ``done`` rows per ``retention``; returns rows deleted."""
        if self.config.retention is None:
            return 0
        deleted = 0
        for name, cfg in self._each_database(None):
            try:
                with self.connection(name) as conn:
                    # Bounded per run: the purge shares the claim queue and must not hold it for
                    # long; the next run (every few minutes) continues where this one stopped.
                    deleted += retention.purge_done(
                        conn,
                        cfg.table,
                        older_than=cfg.retention or 0.0,
                        batch_size=cfg.retention_batch_size,
                        max_batches=PURGE_MAX_BATCHES_PER_RUN,
                    )
            except psycopg.Error as exc:
                if name is None:
                    raise
                # One database down keeps the others' purge going.
                logger.warning(
                    "outbox %s: purge on database %s failed: %s", self.name, name, error_line(exc, cfg.dsn)
                )
        return deleted
