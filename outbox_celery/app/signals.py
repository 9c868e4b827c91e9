"""An outbox's part in a worker's life: after fork, at start-up, at shutdown.

:func:`connect_worker_signals` connects an outbox to Celery's worker signals (and to
``os.register_at_fork``):

- after a fork (a prefork pool process, or any ``fork()``): the process opens its own
  connection pool at first use, never the parent's (``after_fork``);
- ``worker_init``: the worker's pool, concurrency and queues are checked against the outbox's
  settings (``check``; warnings are logged), then ``start`` makes sure the database serves it
  (reachable, migrated, the handlers' subscriptions registered; DESIGN invariant 28) or stops
  the worker's start with :class:`SystemExit`;
- ``worker_process_shutdown`` and ``worker_shutdown``: the batched ``done`` still held is
  written and the pool closed (``shutdown``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from contextlib import suppress
from typing import Any, Protocol

from celery import Celery, signals

__all__ = ["WorkerCheck", "connect_worker_signals"]


class WorkerCheck(Protocol):
    """``Outbox.check_worker_settings``: the checks run at ``worker_init``."""

    def __call__(
        self,
        *,
        pool: str | None = None,
        concurrency: int | None = None,
        queues: Collection[str] | None = None,
    ) -> list[str]: ...


def _pool_name(worker: Any) -> str | None:
    """The worker's pool as a name (``solo``) or its class's module (``celery.concurrency.prefork``)."""
    pool_cls = getattr(worker, "pool_cls", None)
    return pool_cls if isinstance(pool_cls, str) else getattr(pool_cls, "__module__", None)


def connect_worker_signals(
    app: Celery,
    *,
    after_fork: Callable[[], None],
    shutdown: Callable[[], None],
    check: WorkerCheck,
    start: Callable[[Collection[str] | None], None] | None = None,
    shutting_down: Callable[[str], None] | None = None,
) -> None:
    """Connect an outbox bound to ``app`` to the worker's signals (strongly: for the process's life).

    :param after_fork: called in every forked child.
    :param shutdown: called when a pool process or the worker shuts down.
    :param check: called at ``worker_init`` of a worker of ``app`` with its pool, concurrency
        and queues.
    :param start: called at ``worker_init`` of a worker of ``app``, after ``check``, with the
        queues it consumes (``None``: unknown); a :class:`SystemExit` it raises stops the
        worker's start (Celery's signals swallow ``Exception``, not ``SystemExit``).
    :param shutting_down: called in the worker's main process when a shutdown begins, with
        Celery's word for it (``Warm`` or ``Cold``).
    """

    def on_fork(**kwargs: Any) -> None:
        after_fork()

    def on_shutdown(**kwargs: Any) -> None:
        shutdown()

    def on_worker_init(sender: Any = None, **kwargs: Any) -> None:
        if getattr(sender, "app", app) is not app:
            return  # another app's worker in this process
        queues: list[str] | None = None
        with suppress(Exception):  # best effort: only narrows which checks apply
            queues = list(app.amqp.queues.consume_from or {})
        concurrency = getattr(sender, "concurrency", None)
        check(pool=_pool_name(sender), concurrency=concurrency, queues=queues or None)
        if start is not None:
            start(queues or None)

    def on_shutting_down(how: str = "", **kwargs: Any) -> None:
        if shutting_down is not None:
            shutting_down(str(how))

    signals.worker_shutting_down.connect(on_shutting_down, weak=False)
    signals.worker_process_init.connect(on_fork, weak=False)
    signals.worker_process_shutdown.connect(on_shutdown, weak=False)
    signals.worker_shutdown.connect(on_shutdown, weak=False)
    signals.worker_init.connect(on_worker_init, weak=False)
    os.register_at_fork(after_in_child=after_fork)
