"""The :class:`Outbox`: binds an outbox table to a Celery app.

It registers three tasks (``<name>.claim``, ``<name>.deliver``, ``<name>.purge``), installs the
claim (and retention) entries in ``beat_schedule``, routes each event type to its queue, opens a
psycopg pool per worker process after fork and closes it at shutdown.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any, TypeVar

import psycopg
from celery import Celery, signals
from psycopg_pool import ConnectionPool

from . import producer
from ._pool import ForkSafePool, IdleCheck
from ._seconds import seconds
from .backoff import RetryPolicy
from .celery_config import configure_app, dsn_exposed, loaded_conf
from .config import UNSET, OutboxConfig, TableName, Unset
from .dispatch import ClaimRun, Dispatcher, HandlerSpec, default_owner
from .dsn import DSN_ENV
from .errors import ConfigurationError
from .flow import Limit
from .listener import Listener
from .message import Outcome
from .producer import Event
from .publisher import TaskPublisher
from .push import install_listener_step
from .store import Claimed, Store
from .transactional import transaction_kind
from .worker_settings import check_worker_settings

__all__ = ["Outbox"]

_SETTINGS = frozenset(OutboxConfig.__dataclass_fields__)

F = TypeVar("F", bound=Callable[..., Any])


# Retention: at most this many batches of ``retention_batch_size`` per beat-triggered run.
PURGE_MAX_BATCHES_PER_RUN = 20
# The largest batch a batch handler may ask for (#22): the task carries two arrays of this size.
MAX_BATCH = 1000
# Longest max_wait of a batch handler (#22): a batch fills briefly, never for long.
MAX_WAIT = 5.0
# Seconds a pooled connection may sit idle and still be handed out without a check (IdleCheck).
POOL_CHECK_IDLE = 2.0


class _QuietClaims(logging.Filter):
    """Celery's per-task INFO lines about claim tasks, moved to DEBUG.

    Beat sends a claim every ``claim_interval`` and most runs find nothing: Celery's own
    ``Task outbox.claim[...] received`` / ``succeeded`` lines (and beat's ``Sending due task``)
    would fill an INFO log, while a run that did something logs its own INFO line (``outbox
    claim run: claimed=...``). A matching record is dropped unless its logger is enabled for
    DEBUG (``--loglevel DEBUG``), where it shows as a DEBUG record. Failures are untouched.
    """

    def __init__(self) -> None:
        super().__init__()
        self.tasks: set[str] = set()

    def _task(self, record: logging.LogRecord) -> str | None:
        args = record.args
        if isinstance(args, Mapping):  # celery.app.trace, celery.worker.strategy: a context dict
            name = args.get("name")
            return name if isinstance(name, str) else None
        if isinstance(args, tuple) and len(args) == 2 and isinstance(args[1], str):  # celery.beat
            return args[1]
        return None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or self._task(record) not in self.tasks:
            return True
        if not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return False
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return True


_quiet_claims = _QuietClaims()
# Where Celery logs a task's receipt and success, and beat each task it sends.
_TASK_LOGGERS = ("celery.app.trace", "celery.worker.strategy", "celery.beat")


def _quiet_claim_logs(task_name: str) -> None:
    """Keep ``task_name``'s routine receipt/success/sent lines out of INFO logs (idempotent)."""
    _quiet_claims.tasks.add(task_name)
    for name in _TASK_LOGGERS:
        target = logging.getLogger(name)
        if _quiet_claims not in target.filters:
            target.addFilter(_quiet_claims)


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
    :param dsn: and every other keyword named after a field of
        :class:`~outbox_celery.config.OutboxConfig` (``table``, ``lease``, ``batch_size``,
        ``max_attempts``, ``claim_interval``...; meanings and defaults there and in
        docs/celery.md). A setting not given comes from the Celery configuration
        (``outbox_<name>``), then from the default. An unknown name raises
        :class:`~outbox_celery.errors.ConfigurationError`.
    :param store: the :class:`~outbox_celery.store.Store` the dispatcher runs its queries
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
        dsn: str | Unset | None = UNSET,
        table: str | TableName | Unset = UNSET,
        lease: float | timedelta | Unset = UNSET,
        batch_size: int | Unset = UNSET,
        max_attempts: int | Unset = UNSET,
        claim_interval: float | timedelta | Unset = UNSET,
        claim_budget: float | timedelta | Unset | None = UNSET,
        max_in_flight: int | Unset = UNSET,
        min_in_flight: int | Unset | None = UNSET,
        adaptive_in_flight: bool | Unset = UNSET,
        backoff_base: float | timedelta | Unset = UNSET,
        backoff_cap: float | timedelta | Unset = UNSET,
        max_defer_age: float | timedelta | Unset = UNSET,
        max_payload_bytes: int | Unset = UNSET,
        claim_queue: str | Unset = UNSET,
        default_queue: str | Unset = UNSET,
        unroutable_delay: float | timedelta | Unset = UNSET,
        pool_max_size: int | Unset = UNSET,
        retention: float | timedelta | Unset | None = UNSET,
        retention_batch_size: int | Unset = UNSET,
        relaxed_commit: bool | Unset = UNSET,
        configure_celery: bool | Unset = UNSET,
        max_clock_skew: float | timedelta | Unset = UNSET,
        broker_timeout: float | timedelta | Unset = UNSET,
        claim_time_limit: float | timedelta | Unset | None = UNSET,
        prepare_threshold: int | Unset | None = UNSET,
        lease_heartbeat: bool | Unset = UNSET,
        handler_time_limit: float | timedelta | Unset | None = UNSET,
        listen: bool | Unset = UNSET,
        listen_dsn: str | Unset | None = UNSET,
        listen_poll: float | timedelta | Unset = UNSET,
        done_batch_delay: float | timedelta | Unset = UNSET,
        scan_lookback: float | timedelta | Unset = UNSET,
        full_scan_interval: float | timedelta | Unset = UNSET,
        unreachable_exit_after: float | timedelta | Unset | None = UNSET,
        store: Store | None = None,
        retry: RetryPolicy | None = None,
        **unknown: Any,
    ) -> None:
        # Only the settings the caller gave: the others come from the Celery configuration.
        settings = {k: v for k, v in locals().items() if k in _SETTINGS and v is not UNSET}
        if unknown:
            raise ConfigurationError(f"unknown outbox setting(s): {', '.join(sorted(unknown))}")
        self._store = store
        self._retry = retry
        self.app = app
        self.name = name
        self._settings = settings
        self._config: OutboxConfig | None = None
        self._handlers: dict[str, HandlerSpec] = {}
        self._pool = ForkSafePool(self._open_pool)
        self._idle_check = IdleCheck(POOL_CHECK_IDLE)
        self._dispatcher: Dispatcher | None = None
        self._last_drained: float | None = None
        self._publisher: TaskPublisher | None = None
        #: The push listener running in this worker process, if any (docs/push.md).
        self.listener: Listener | None = None
        self._register_tasks()
        _quiet_claim_logs(f"{name}.claim")  # the name, not the task: reading it would load the config
        self._connect_signals()
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
        """The resolved settings (keyword arguments > Celery ``outbox_*`` > defaults)."""
        if self._config is None:
            config = OutboxConfig.from_mapping(loaded_conf(self.app), **self._settings)
            if config.dsn is None and os.environ.get(DSN_ENV):
                # Read from the environment, the DSN never enters app.conf, which `celery
                # report` and `celery inspect conf` print (Celery masks only names it knows).
                config = config.replace(dsn=os.environ[DSN_ENV])
            self._config = config
        return self._config

    @property
    def store(self) -> Store:
        """The SQL layer bound to this outbox's table."""
        return self.dispatcher.store

    @property
    def dispatcher(self) -> Dispatcher:
        """Claim/deliver logic bound to this process's pool."""
        if self._dispatcher is None:
            self._dispatcher = Dispatcher(
                self.config,
                self.connection,
                self._handlers,
                store=self._store,
                retry=self._retry,
                recover=self._check_pool,
            )
        return self._dispatcher

    @property
    def handlers(self) -> dict[str, HandlerSpec]:
        """Registered handlers by event type."""
        return dict(self._handlers)

    def handler(
        self,
        event_type: str,
        *,
        queue: str | None = None,
        transactional: bool | str = False,
        session_factory: Callable[[], Any] | None = None,
        using: str | None = None,
        batch: int | None = None,
        max_wait: float | timedelta | None = None,
        concurrency: int | None = None,
        rate: str | float | None = None,
        key_concurrency: int | None = None,
        key_rate: str | float | None = None,
    ) -> Callable[[F], F]:
        """Register the function that delivers ``event_type`` (one per event type).

        The handler receives a :class:`~outbox_celery.message.Message` and runs outside any
        database transaction. It raises :class:`~outbox_celery.errors.RetryableError`,
        :class:`~outbox_celery.errors.PermanentError` or :class:`~outbox_celery.errors.Defer` to
        say what happened; returning normally means delivered.

        A *transactional* handler (docs/transactional.md, DESIGN invariant 20) receives
        ``(message, conn)`` and runs inside one transaction on the outbox's database whose last
        statement is the fenced ``done``: its writes (and the events it enqueues on ``conn``)
        commit exactly when the done does. A run whose claim was superseded, or that raises,
        rolls them back.

        :param queue: the Celery queue its delivery tasks go to (default: ``default_queue``).
        :param transactional: ``False`` (default), ``True`` or ``"psycopg"`` (``conn`` is a
            ``psycopg.Connection`` of the outbox's pool), ``"sqlalchemy"`` (``conn`` is a
            ``Session`` from ``session_factory``) or ``"django"`` (``conn`` is Django's
            connection, the handler runs inside ``transaction.atomic()``).
        :param session_factory: with ``transactional="sqlalchemy"``: returns a new ``Session``
            on the outbox's database (psycopg 3 dialect), e.g. a ``sessionmaker``.
        :param using: with ``transactional="django"``: the database alias (default
            ``"default"``).
        :param batch: make it a *batch handler* (docs/batch.md, DESIGN invariant 21): it receives
            a list of up to ``batch`` messages of ``event_type`` (sorted by id), carried by one
            Celery task, started and finished by one fenced statement each. It returns ``None``
            (every message delivered) or a mapping from message id to a
            :class:`~outbox_celery.errors.RetryableError`, :class:`~outbox_celery.errors.Defer`
            or :class:`~outbox_celery.errors.PermanentError` instance for those that were not;
            an exception it raises applies to the whole batch. An int from 1 to
            :data:`MAX_BATCH`; not with ``transactional``. A batch is cut from one claim, so
            it holds at most ``batch_size`` rows and at most one message per ordering key.
        :param max_wait: with ``batch``: seconds (0 to :data:`MAX_WAIT`, or a ``timedelta``)
            that due unordered messages of ``event_type`` may wait for a fuller batch: a claim
            leaves them while they are fewer than a batch and the oldest has been due less than
            this (database clock), and the push listener claims again when it has. Default 0,
            never wait. Not with ``concurrency`` or ``rate`` (docs/batch.md).
        :param concurrency: at most this many live deliveries of ``event_type`` at once, across
            every worker and machine (claimed or running rows under a live lease; a worker that
            dies gives its slot back when its lease ends). Enforced by the claim, which hands
            out no more (docs/flow-control.md, DESIGN invariant 22). Default: no bound.
        :param rate: at most this many deliveries of ``event_type`` start per second, across
            every worker: Celery's rate forms ``"50/s"``, ``"3000/m"``, ``"10/h"``, or a number
            (per second). Enforced by the claim with a token bucket holding ``max(1, rate x
            0.2 s)`` starts. Default: no bound. A bad value raises
            :class:`~outbox_celery.errors.ConfigurationError` (a ``ValueError``).
        :param key_concurrency: at most this many live deliveries per limit key (the
            ``limit_key`` given at enqueue: a tenant, a downstream host), counted as
            ``concurrency`` is; the claim takes the type's keyed rows key by key, round robin,
            so one busy key does not starve the others (DESIGN invariant 24). Default: no bound.
        :param key_rate: at most this many deliveries per limit key start per second (rate
            forms as ``rate``), a token bucket per key kept in the database. Default: no bound.
        """
        if not isinstance(event_type, str) or not event_type:
            raise ConfigurationError("event_type must be a non-empty string")
        if batch is not None:
            if isinstance(batch, bool) or not isinstance(batch, int):
                raise ConfigurationError(f"batch must be an int from 1 to {MAX_BATCH}, not {batch!r}")
            if not 1 <= batch <= MAX_BATCH:
                raise ConfigurationError(f"batch must be from 1 to {MAX_BATCH}, not {batch}")
            if transactional is not False:
                raise ConfigurationError(
                    f"the handler of {event_type!r} cannot be both batch= and transactional=: a "
                    "transactional handler commits one message's writes with its done (DESIGN "
                    "invariant 20); register a plain batch handler, or a transactional one-message "
                    "handler"
                )
        kind = transaction_kind(transactional, session_factory=session_factory, using=using)
        limit = Limit.declared(
            concurrency=concurrency, rate=rate, key_concurrency=key_concurrency, key_rate=key_rate
        )
        wait = 0.0 if max_wait is None else seconds(max_wait, "max_wait", error=ConfigurationError)
        if wait and batch is None:
            raise ConfigurationError(f"max_wait is for batch handlers: give {event_type!r} batch= too")
        if wait > MAX_WAIT:
            raise ConfigurationError(
                f"max_wait must be at most {MAX_WAIT:g} s (a batch fills briefly), got {wait:g}"
            )
        if wait and limit is not None:
            raise ConfigurationError(
                f"max_wait cannot be combined with concurrency=, rate=, key_concurrency= or key_rate= "
                f"(the handler of {event_type!r}): "
                "a limited type is claimed by statements of its own"
            )

        def register(fn: F) -> F:
            if event_type in self._handlers:
                raise ConfigurationError(f"a handler for {event_type!r} is already registered")
            spec = HandlerSpec(
                event_type, fn, queue or "", transaction=kind, batch=batch, limit=limit, max_wait=wait
            )
            self._handlers[event_type] = spec
            return fn

        return register

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
        the checks are :func:`outbox_celery.worker_settings.check_worker_settings`.

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

    # -- connections ---------------------------------------------------------------------------

    @property
    def pool(self) -> ConnectionPool[Any]:
        """This process's connection pool (opened lazily, again after a fork)."""
        return self._pool.get()

    def _open_pool(self) -> ConnectionPool[Any]:
        # No local holds the DSN (#21): error reporters that record frame locals would send it.
        if not self.config.dsn:
            raise ConfigurationError(
                f"no DSN: set {DSN_ENV}, pass Outbox(app, dsn=...) or set outbox_dsn in the Celery config"
            )
        return ConnectionPool(
            self.config.dsn,
            min_size=1,
            max_size=self.config.pool_max_size,
            kwargs={
                "autocommit": True,
                "application_name": f"outbox-celery:{self.name}",
                # None behind PgBouncer < 1.21 in transaction pooling (docs/celery.md).
                "prepare_threshold": self.config.prepare_threshold,
            },
            name=f"outbox-{self.name}",
            # A connection the server closed while it sat idle (restart, failover,
            # pg_terminate_backend) is replaced before use, not handed to a delivery whose
            # fenced write would then fail. Only idle ones: a round trip per checkout cost as
            # much as the fenced writes themselves (#12); the rest are covered by the retry.
            check=self._idle_check,
            open=True,
        )

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled autocommit connection."""
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

    def close(self) -> None:
        """Write the batched ``done`` still held, then close this process's pool and publishing
        connection (idempotent)."""
        if self._dispatcher is not None:
            self._dispatcher.flush()
        self._pool.close()
        if self._publisher is not None:
            self._publisher.close()

    def _after_fork(self, **kwargs: Any) -> None:
        self._pool.after_fork()

    def _on_shutdown(self, **kwargs: Any) -> None:
        self.close()

    def _on_worker_init(self, sender: Any = None, **kwargs: Any) -> None:
        if getattr(sender, "app", self.app) is not self.app:
            return  # another app's worker in this process
        pool_cls = getattr(sender, "pool_cls", None)
        pool = pool_cls if isinstance(pool_cls, str) else getattr(pool_cls, "__module__", None)
        queues: list[str] | None = None
        with suppress(Exception):  # best effort: only narrows which checks apply
            queues = list(self.app.amqp.queues.consume_from or {})
        self.check_worker_settings(
            pool=pool, concurrency=getattr(sender, "concurrency", None), queues=queues or None
        )

    def _connect_signals(self) -> None:
        signals.worker_process_init.connect(self._after_fork, weak=False)
        signals.worker_process_shutdown.connect(self._on_shutdown, weak=False)
        signals.worker_shutdown.connect(self._on_shutdown, weak=False)
        signals.worker_init.connect(self._on_worker_init, weak=False)
        os.register_at_fork(after_in_child=self._after_fork)

    # -- tasks ---------------------------------------------------------------------------------

    def _register_tasks(self) -> None:
        outbox = self

        # shared=False: these tasks close over this Outbox; they must not be copied into every
        # other app created in the process (Celery's default for decorated tasks).
        @self.app.task(name=f"{self.name}.claim", ignore_result=True, acks_late=False, shared=False)
        def claim() -> dict[str, Any]:
            """Reap, claim and publish (triggered by beat every ``claim_interval``)."""
            return outbox._claim_coalesced().as_dict()

        # Both delivery tasks: acked late, and a lost worker acks its message too (every row
        # comes back through its lease, fenced); never Celery's retries (DESIGN invariant 14).
        delivery: dict[str, Any] = {
            "ignore_result": True,
            "acks_late": True,
            "reject_on_worker_lost": False,
            "max_retries": 0,
            "shared": False,
        }

        @self.app.task(name=f"{self.name}.deliver", **delivery)
        def deliver(outbox_id: int, lease_version: int) -> str:
            """Deliver one outbox row (fenced start, handler, fenced finalize)."""
            return outbox.dispatcher.deliver(int(outbox_id), int(lease_version), batch_done=True)

        @self.app.task(name=f"{self.name}.deliver_batch", **delivery)
        def deliver_batch(ids: list[int], versions: list[int]) -> dict[str, int]:
            """Deliver a batch handler's rows (one fenced start, the handler, one fenced finalize)."""
            return outbox.dispatcher.deliver_batch(list(zip(ids, versions, strict=True)))

        @self.app.task(name=f"{self.name}.purge", ignore_result=True, shared=False)
        def purge() -> int:
            """Delete ``done`` rows older than ``retention`` in bounded batches."""
            return outbox.purge()

        self.claim_task = claim
        self.deliver_task = deliver
        self.deliver_batch_task = deliver_batch
        self.purge_task = purge

    @property
    def publisher(self) -> TaskPublisher:
        """Sends this process's claimed rows to the broker: the claim run's
        :class:`~outbox_celery.dispatch.Publisher`, created at first use."""
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

    def task_id(self, claim: Claimed) -> str:
        """Deterministic Celery task id of a claimed row: ``<table>:<id>:v<version>``.

        Delegates to :meth:`TaskPublisher.task_id <outbox_celery.publisher.TaskPublisher.task_id>`.
        """
        return self.publisher.task_id(claim)

    def batch_task_id(self, unit: Sequence[Claimed]) -> str:
        """Deterministic Celery task id of a batch task: its first claim's, then ``+<size>``.

        Delegates to :meth:`TaskPublisher.batch_task_id
        <outbox_celery.publisher.TaskPublisher.batch_task_id>`.
        """
        return self.publisher.batch_task_id(unit)

    def publish(self, claims: Sequence[Claimed]) -> int:
        """Send one delivery task per claim (per group, for batch handlers); returns how many
        claims were sent, a prefix of ``claims``. Delegates to :attr:`publisher`
        (:class:`~outbox_celery.publisher.TaskPublisher`).
        """
        return self.publisher(claims)

    def claim(self) -> ClaimRun:
        """Run one claim (what the beat-triggered task does); usable without Celery workers."""
        # Through the method, not the publisher itself: a wrapper set on the instance's
        # ``publish`` (benchmarks/hooks.py times publishes so) sees every claim run's publishes.
        return self.dispatcher.claim_and_publish(self.publish, owner=default_owner())

    def _claim_coalesced(self) -> ClaimRun:
        """The claim task's body: a claim run, unless this process just drained the table.

        Claim tasks pile up behind a claim worker that was stopped or paused while beat kept
        sending (their ``expires`` leaves minutes for clock skew). Run back to back they would
        each claim an empty batch; a run that arrives within half a ``claim_interval`` of this
        process's last run that found nothing more to claim returns at once. Durations are
        measured on this process's monotonic clock, never compared with another's.
        """
        last = self._last_drained
        if last is not None and time.monotonic() - last < self.config.claim_interval / 2:
            return ClaimRun(skipped=True, stopped_by="coalesced")
        run = self.claim()
        self._last_drained = time.monotonic() if run.stopped_by == "drained" else None
        return run

    def enqueue(self, conn: Any, **event: Any) -> int:
        """:func:`~outbox_celery.enqueue` into this outbox's ``table``, within ``max_payload_bytes``.

        ``event`` takes :func:`~outbox_celery.enqueue`'s keywords (``event_type``, ``payload``,
        ``aggregate_type``, ``aggregate_id``, ...); ``conn`` is any connection it accepts.
        """
        return producer.enqueue(conn, **self._producer_defaults(event))

    def enqueue_many(
        self, conn: Any, messages: Iterable[Event | Mapping[str, Any]], **options: Any
    ) -> list[int]:
        """:func:`~outbox_celery.enqueue_many` with this outbox's ``table`` and ``max_payload_bytes``."""
        return producer.enqueue_many(conn, messages, **self._producer_defaults(options))

    def _producer_defaults(self, options: dict[str, Any]) -> dict[str, Any]:
        return {"table": self.config.table, "max_payload_bytes": self.config.max_payload_bytes, **options}

    def pause(self, event_type: str, *, limit_key: str | None = None) -> bool:
        """Pause ``event_type`` (or only its ``limit_key``) in this outbox's table: no claim
        hands out its messages until :meth:`resume` (docs/flow-control.md, DESIGN invariants 23,
        24). Deliveries already running finish. Returns whether it was running before
        (``False``: already paused).
        """
        from .admin import pause

        with self.connection() as conn:
            return pause(conn, self.config.table, event_type, limit_key=limit_key)

    def resume(self, event_type: str, *, limit_key: str | None = None) -> bool:
        """Resume ``event_type`` (or only its ``limit_key``): it is claimable at once (the push
        listeners are woken), and a RateLimited hold on it ends too. Returns whether it was
        paused or held.
        """
        from .admin import resume

        with self.connection() as conn:
            return resume(conn, self.config.table, event_type, limit_key=limit_key)

    def deliver(self, outbox_id: int, lease_version: int) -> Outcome:
        """Deliver one row in this process (what the delivery task does)."""
        return self.dispatcher.deliver(outbox_id, lease_version)

    def deliver_batch(self, pairs: Sequence[tuple[int, int]]) -> dict[str, int]:
        """Deliver ``(id, lease_version)`` pairs of a batch handler in this process (what the
        batch task does); returns how many rows ended in each outcome (docs/batch.md)."""
        return self.dispatcher.deliver_batch(pairs)

    def purge(self) -> int:
        """Delete old ``done`` rows per ``retention``; returns rows deleted."""
        cfg = self.config
        if cfg.retention is None:
            return 0
        from .admin import purge_done

        with self.connection() as conn:
            # Bounded per run: the purge shares the claim queue and must not hold it for long;
            # the next run (every few minutes) continues where this one stopped.
            return purge_done(
                conn,
                cfg.table,
                older_than=cfg.retention,
                batch_size=cfg.retention_batch_size,
                max_batches=PURGE_MAX_BATCHES_PER_RUN,
            )
