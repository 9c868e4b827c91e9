"""What an :class:`~outbox_celery.app.outbox.Outbox` writes into its Celery app's configuration.

:func:`configure_app` routes the outbox's tasks to their queues, adds the claim (and retention)
entries to ``beat_schedule``, applies the recommended settings (:func:`apply_recommended`) and
refuses a broker that would redeliver a running delivery. The checks a worker runs at start-up
are :mod:`outbox_celery.app.worker_settings`. Each function takes the app or its configuration
explicitly: nothing here holds state.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from contextlib import suppress
from typing import Any

import psycopg
from celery import Celery, Task

from ..config import OutboxConfig
from ..dsn import password
from ..errors import ConfigurationError
from .worker_settings import is_redis, redelivery_problem

__all__ = ["apply_recommended", "configure_app", "dsn_exposed", "loaded_conf", "user_set"]

# The Outbox's logger: these lines have always come from there, and logging configs name it.
logger = logging.getLogger("outbox_celery.app.outbox")


def loaded_conf(app: Celery) -> Any:
    """``app.conf``, loaded: a pending configuration only shows what was set before loading."""
    if not getattr(app, "configured", True):
        with suppress(KeyError):
            app.conf["broker_url"]  # reading any key loads the configuration
    return app.conf


def user_set(conf: Any, key: str) -> bool:
    """Whether ``key`` was set by the user in ``conf``, not just left at Celery's default."""
    maps = getattr(conf, "maps", None)
    if not maps:
        return key in conf
    to_keys = getattr(conf, "_to_keys", None)
    keys = to_keys(key) if callable(to_keys) else (key,)
    # The last map holds Celery's defaults; the others are what the app was configured with.
    return any(k in m for m in maps[:-1] for k in keys)


def _routers(routes: Any) -> tuple[Any, ...]:
    """``task_routes`` as a tuple of routers (it may be one router or a sequence of them)."""
    if routes is None:
        return ()
    if isinstance(routes, list | tuple):
        return tuple(routes)
    return (routes,)


def dsn_exposed(cfg: OutboxConfig, conf: Any, *, given: Collection[str]) -> bool:
    """Whether a DSN with a password sits in the Celery configuration ``conf`` (printed by Celery).

    ``outbox_dsn`` and ``outbox_listen_dsn`` both.

    :param given: the settings passed to the ``Outbox`` itself, which never enter ``conf``.
    """
    for name, value in (("dsn", cfg.dsn), ("listen_dsn", cfg.listen_dsn)):
        if name in given or not value or not user_set(conf, f"outbox_{name}"):
            continue
        try:
            if password(value) is not None:
                return True
        except psycopg.Error:
            return True  # unparseable: assume the worst
    return False


def configure_app(app: Celery, cfg: OutboxConfig, *, name: str, claim_task: Task[Any, Any]) -> None:
    """Write outbox ``name``'s routes, beat entries and recommended settings into ``app.conf``.

    Routes ``<name>.claim`` and ``<name>.purge`` to the claim queue and both delivery tasks to
    the default queue (after the user's own ``task_routes``); gives ``claim_task`` and its beat
    entry the claim time limits; adds the ``<name>-claim`` (and, with ``retention``,
    ``<name>-purge``) beat entries unless present; applies :func:`apply_recommended` when
    ``configure_celery`` is on.

    :raises ConfigurationError: the broker would redeliver a running delivery
        (:func:`~outbox_celery.app.worker_settings.redelivery_problem`).
    """
    conf = app.conf
    # Manual calls (``outbox.deliver_task.delay(...)``, ``claim_task.delay()``) land on the
    # outbox's queues too; the user's own task_routes are consulted first.
    conf.task_routes = (
        *_routers(conf.task_routes),
        {
            f"{name}.claim": {"queue": cfg.claim_queue},
            f"{name}.purge": {"queue": cfg.claim_queue},
            f"{name}.deliver": {"queue": cfg.default_queue},
            f"{name}.deliver_batch": {"queue": cfg.default_queue},
        },
    )
    # A claim run holds the claim lock: one stuck in a hung publish must end (its rows are
    # then released). Set on the task too, for claims sent by hand.
    claim_soft, claim_hard = cfg.claim_time_limits
    # Celery takes fractional seconds here (the stubs say int).
    claim_task.soft_time_limit = claim_soft  # type: ignore[assignment]
    claim_task.time_limit = claim_hard  # type: ignore[assignment]
    schedule = dict(conf.beat_schedule or {})
    schedule.setdefault(
        f"{name}-claim",
        {
            "task": f"{name}.claim",
            "schedule": cfg.claim_interval,
            # Celery checks ``expires`` on the worker's clock (invariant 13): one tick would
            # make a worker 1 s ahead of beat discard every claim, so it gets the skew
            # allowance on top. Claims that pile up behind a stalled claim worker are
            # coalesced by the claim task instead (and the claim lock makes any extra cheap).
            "options": {
                "queue": cfg.claim_queue,
                "expires": cfg.claim_interval + cfg.max_clock_skew,
                "soft_time_limit": claim_soft,
                "time_limit": claim_hard,
            },
        },
    )
    if cfg.retention is not None:
        schedule.setdefault(
            f"{name}-purge",
            {
                "task": f"{name}.purge",
                "schedule": min(600.0, max(60.0, cfg.retention / 10)),
                "options": {"queue": cfg.claim_queue, "expires": 60.0},
            },
        )
    conf.beat_schedule = schedule
    if cfg.configure_celery:
        apply_recommended(cfg, conf)
    # After the defaults: a broker that would redeliver a running delivery stops worker and
    # beat here, with the reason, rather than a warning nobody reads.
    problem = redelivery_problem(cfg, conf)
    if problem:
        raise ConfigurationError(f"outbox settings: {problem}")


def apply_recommended(cfg: OutboxConfig, conf: Any) -> None:
    """Set the Celery settings the outbox needs where the user left Celery's default.

    ``worker_prefetch_multiplier=1`` unless set, and on Redis a ``visibility_timeout`` above the
    delivery's time limit plus a lease unless ``broker_transport_options`` has one.
    """
    applied = []
    if not user_set(conf, "worker_prefetch_multiplier"):
        # Reserved-but-unstarted deliveries sit in a worker while their lease runs.
        conf.worker_prefetch_multiplier = 1
        applied.append("worker_prefetch_multiplier=1")
    if is_redis(conf.broker_url):
        options = dict(conf.broker_transport_options or {})
        if "visibility_timeout" not in options:
            # Redis redelivers unacked (acks_late) messages after this; it must exceed the
            # delivery's time limit plus a lease (handler_time_limit with the heartbeat).
            options["visibility_timeout"] = max(3600.0, cfg.lease * 4, 2 * cfg.min_redelivery_timeout)
            conf.broker_transport_options = options
            applied.append(f"broker_transport_options.visibility_timeout={options['visibility_timeout']:g}")
    if applied:
        logger.debug("outbox applied Celery settings: %s", ", ".join(applied))
