"""The Celery side of push: a worker bootstep that runs the :class:`Listener`.

The step starts after the worker's pool (prefork children are forked before the listener's
thread and connection exist) and only in workers that consume the outbox's claim queue: the
process beat's claims go to is the one that claims on notifications too. The claim runs in the
worker's main process, in the listener's thread, not through the broker: no broker round trip
and no wait for a free pool process behind deliveries (docs/push.md has the measurements).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from celery import Celery, bootsteps
from celery.platforms import EX_FAILURE
from celery.worker import state as worker_state

from ..claim.claimer import ClaimRun
from ..claim.listener import Listener
from ..config import OutboxConfig
from ..db.store import Store
from ..handlers import HandlerSpec

if TYPE_CHECKING:
    from .lanes import Lane, Lanes

__all__ = ["DatabaseListeners", "ListenedOutbox", "install_listener_step", "listener_for"]

logger = logging.getLogger(__name__)


class ListenedOutbox(Protocol):
    """What the push step needs of an outbox: an :class:`~outbox_celery.app.outbox.Outbox` is one.

    Described here rather than imported, so that this module does not import ``celery_app``
    (which imports it to install the step).
    """

    app: Celery
    name: str
    #: The listener running in this worker process, set and cleared by the step.
    listener: Listener | None
    #: With several databases: the listeners running in this worker process, by database.
    listeners: dict[str, Listener]

    @property
    def config(self) -> OutboxConfig: ...

    @property
    def lanes(self) -> Lanes | None: ...

    def claim_database(self, database: str) -> ClaimRun: ...

    @property
    def store(self) -> Store: ...

    @property
    def handlers(self) -> Mapping[str, HandlerSpec]: ...

    def claim(self) -> ClaimRun: ...


def _consumes(outbox: ListenedOutbox, worker: Any) -> bool:
    try:
        queues = worker.app.amqp.queues.consume_from
        return outbox.config.claim_queue in (queues or {})
    except Exception:  # pragma: no cover - a worker without the usual amqp wiring
        return False


def listener_for(outbox: ListenedOutbox) -> Listener:
    """A :class:`Listener` that claims for ``outbox`` in this process."""
    cfg = outbox.config
    dsn = cfg.listen_dsn or cfg.dsn
    assert dsn is not None
    return Listener(
        dsn=dsn,
        store=outbox.store,
        claim=outbox.claim,
        event_types=lambda: sorted(outbox.handlers),
        poll=cfg.listen_poll,
        name=outbox.name,
        exit_after=cfg.unreachable_exit_after,
        on_unreachable=_stop_worker,
        prepare_threshold=cfg.prepare_threshold,
    )


def lane_listener(outbox: ListenedOutbox, lane: Lane) -> Listener:
    """A :class:`Listener` that claims ``lane``'s database for ``outbox`` in this process.

    A database that does not answer never stops the worker (``unreachable_exit_after`` is for
    one database): it is retried with backoff while the others are served (DESIGN invariant 34).
    """
    cfg = lane.config
    dsn = cfg.listen_dsn or cfg.dsn
    assert dsn is not None
    name = lane.name
    return Listener(
        dsn=dsn,
        store=lane.store,
        claim=lambda: outbox.claim_database(name),
        event_types=lambda: sorted(outbox.handlers),
        poll=cfg.listen_poll,
        idle_poll=cfg.idle_sweep,
        # The beat-triggered claim leaves a quiet database to its listener (idle_sweep): one
        # that lost its connection reconnects within a claim interval, as beat would claim it.
        max_backoff=min(10.0, max(1.0, cfg.claim_interval)),
        name=f"{outbox.name}:{name}",
        prepare_threshold=cfg.prepare_threshold,
        # A database host that does not answer holds its listener for connection_wait at most,
        # not for the kernel's SYN retries.
        connect_timeout=lane.connect_timeout,
    )


class DatabaseListeners:
    """The push listeners of an outbox that serves several databases: one per database.

    A thread of its own starts them, then reads the declared databases again every
    ``databases_refresh`` seconds (a ``databases`` callable): a new database gets its
    listener, a removed one's stops.
    """

    def __init__(self, outbox: ListenedOutbox) -> None:
        self.outbox = outbox
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # The lane each listener was started for.
        self._lanes: dict[str, Lane] = {}

    def start(self) -> None:
        """Start the listeners (returns at once)."""
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, name=f"outbox-listeners-{self.outbox.name}", daemon=True
        )
        self._thread.start()

    def sync(self) -> None:
        """Start a listener for each database without one, stop those of removed databases and
        start again those whose declaration changed (a new DSN or table gives a new lane)."""
        lanes = self.outbox.lanes
        if lanes is None:
            return
        lanes.refresh()
        current = {lane.name: lane for lane in lanes.lanes()}
        listeners = self.outbox.listeners
        for name in [n for n in listeners if current.get(n) is not self._lanes.get(n)]:
            listeners.pop(name).stop()
            self._lanes.pop(name, None)
        for name, lane in current.items():
            if name not in listeners and not self._stop.is_set():
                listeners[name] = lane_listener(self.outbox, lane)
                self._lanes[name] = lane
                listeners[name].start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception as exc:  # a databases callable that fails: the last ones go on
                logger.error("outbox %s: listeners not updated: %s", self.outbox.name, exc)
            self._stop.wait(self.outbox.config.databases_refresh)

    def stop(self) -> None:
        """Stop every listener (each finishes its claim run first)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(5.0)
        listeners = self.outbox.listeners
        while listeners:
            _, listener = listeners.popitem()
            listener.stop()


def _stop_worker() -> None:
    """A warm shutdown with exit code 1, as Celery's own SIGTERM handler starts one: the worker's
    loop reads the flag and raises ``WorkerShutdown`` (the listener's thread cannot)."""
    worker_state.should_stop = EX_FAILURE  # type: ignore[assignment]  # Celery types it as None


def install_listener_step(outbox: ListenedOutbox) -> None:
    """Add a worker bootstep that runs ``outbox``'s listener where it applies."""

    class OutboxListener(bootsteps.StartStopStep):
        """Runs the outbox listener in a worker that consumes the claim queue."""

        name = f"outbox_celery.app.push.OutboxListener[{outbox.name}]"
        label = f"outbox listener {outbox.name}"
        requires = ("celery.worker.components:Pool",)

        def __init__(self, parent: Any, **kwargs: Any) -> None:
            super().__init__(parent, **kwargs)
            self.listener: Listener | None = None
            self.databases: DatabaseListeners | None = None

        def start(self, parent: Any) -> None:
            if getattr(parent, "app", outbox.app) is not outbox.app:
                return
            cfg = outbox.config
            if not cfg.listen or not _consumes(outbox, parent):
                return
            if cfg.databases is not None:
                if not outbox.handlers:
                    logger.warning("outbox listener %s not started: no handlers", outbox.name)
                    return
                self.databases = DatabaseListeners(outbox)
                self.databases.start()
                return
            if not outbox.handlers or not (cfg.listen_dsn or cfg.dsn):
                logger.warning("outbox listener %s not started: no handlers or no DSN", outbox.name)
                return
            self.listener = listener_for(outbox)
            outbox.listener = self.listener
            self.listener.start()

        def stop(self, parent: Any) -> None:
            databases, self.databases = self.databases, None
            if databases is not None:
                databases.stop()
            listener, self.listener = self.listener, None
            if listener is not None:
                listener.stop()
                if outbox.listener is listener:
                    outbox.listener = None

        def terminate(self, parent: Any) -> None:
            self.stop(parent)

        def shutdown(self, parent: Any) -> None:
            self.stop(parent)

    outbox.app.steps["worker"].add(OutboxListener)
