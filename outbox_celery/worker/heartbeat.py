"""Optional automatic lease heartbeat for long handlers (setting ``lease_heartbeat``).

While a handler runs, a thread extends the row's lease (fenced on ``lease_version``, as
:meth:`~outbox_celery.message.Message.extend_lease` does) every third of a lease, so a handler
may run longer than one lease without being claimed again. It stops when the handler returns or
raises, when an extension finds the lease lost (another claim took the row: extending further
could only fail), and once the handler has run for the delivery's time limit
(:attr:`~outbox_celery.config.OutboxConfig.task_time_limit`, which with the heartbeat on is
``handler_time_limit``): the prefork pool kills the handler then, and on pools without time
limits the lease simply runs out one lease later, so a hung handler never holds its row forever.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..config import OutboxConfig

__all__ = ["lease_heartbeat"]

logger = logging.getLogger(__name__)


@contextmanager
def lease_heartbeat(
    config: OutboxConfig, extend: Callable[[float], bool], *, log: dict[str, Any] | None = None
) -> Iterator[None]:
    """Keep extending a lease from a thread while the ``with`` block runs.

    :param config: the outbox settings; nothing happens unless ``lease_heartbeat`` is on.
    :param extend: the fenced extension (``seconds -> won``) of the row being delivered.
    :param log: structured fields for the heartbeat's log lines (outbox id, lease_version...).
    """
    if not config.lease_heartbeat:
        yield
        return
    stop = threading.Event()
    thread = threading.Thread(
        target=_beat, args=(config, extend, stop, dict(log or {})), name="outbox-lease-heartbeat", daemon=True
    )
    thread.start()
    try:
        yield
    finally:
        stop.set()
        # An extension in flight finishes on its own; the handler's outcome need not wait long.
        thread.join(timeout=config.lease / 3)


def _beat(
    config: OutboxConfig, extend: Callable[[float], bool], stop: threading.Event, log: dict[str, Any]
) -> None:
    interval = config.lease / 3
    # Measured on this process's monotonic clock: a duration, never compared with another clock.
    give_up = time.monotonic() + config.task_time_limit
    while not stop.wait(interval):
        if time.monotonic() >= give_up:
            logger.warning(
                "outbox lease heartbeat stops: the handler ran for its time limit (%.0fs)",
                config.task_time_limit,
                extra={**log, "outcome": "heartbeat_time_limit"},
            )
            return
        try:
            won = extend(config.lease)
        except Exception as exc:  # a database hiccup: the next beat tries again, within the lease
            logger.warning(
                "outbox lease heartbeat failed: %s", exc, extra={**log, "outcome": "heartbeat_error"}
            )
            continue
        if not won:
            # Fenced off: another claim owns the row now; this run's finalize will be too.
            logger.warning("outbox lease heartbeat stops: lease lost", extra={**log, "outcome": "lost_lease"})
            return
