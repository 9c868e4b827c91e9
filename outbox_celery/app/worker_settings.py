"""Celery settings that work against the outbox, checked when a worker starts.

:meth:`Outbox.check_worker_settings <outbox_celery.app.outbox.Outbox.check_worker_settings>`
runs :func:`check_worker_settings` at ``worker_init`` with the worker's pool, concurrency and
queues; the checks need nothing but the resolved settings, so they live apart from the wiring.
What the outbox writes into the Celery configuration itself is :mod:`outbox_celery.app.celery_config`.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

from ..config import OutboxConfig
from ..dsn import DSN_ENV

__all__ = ["check_worker_settings", "is_redis", "redelivery_problem"]

# The Outbox's logger: the warnings have always come from there, and logging configs name it.
logger = logging.getLogger("outbox_celery.app.outbox")

# Pools where Celery cannot enforce task time limits (gevent enforces them at the handler's next
# cooperative switch).
_POOLS_WITHOUT_TIME_LIMITS = ("solo", "threads", "thread", "eventlet")
# Pools whose tasks run concurrently in one process, sharing its connection pool.
_POOLS_SHARING_ONE_PROCESS = ("threads", "thread", "gevent", "eventlet")


def is_redis(url: Any) -> bool:
    """Whether ``url`` names a Redis (or Sentinel) broker."""
    return str(url or "").startswith(("redis", "rediss", "sentinel"))


# kombu's Redis transport redelivers unacknowledged messages after this many seconds by default.
REDIS_DEFAULT_VISIBILITY_TIMEOUT = 3600.0


def redelivery_problem(cfg: OutboxConfig, conf: Any) -> str | None:
    """Why the broker would redeliver a running delivery, or ``None``.

    On Redis the ``visibility_timeout`` (kombu's default 3600 s when unset) must exceed
    :attr:`~outbox_celery.config.OutboxConfig.min_redelivery_timeout` (the delivery's time limit
    plus a lease). RabbitMQ's ``consumer_timeout`` is a server setting the client cannot read:
    docs/celery.md says how to set it.
    """
    if not is_redis(conf.broker_url):
        return None
    options = conf.broker_transport_options or {}
    vt = float(options.get("visibility_timeout", REDIS_DEFAULT_VISIBILITY_TIMEOUT))
    floor = cfg.min_redelivery_timeout
    if vt > floor:
        return None
    return (
        f"broker visibility_timeout={vt:g}s is not above the delivery's time limit plus a lease "
        f"({cfg.task_time_limit:g}s + {cfg.lease:g}s = {floor:g}s; the limit is "
        f"{'handler_time_limit' if cfg.lease_heartbeat else '0.9 x lease'}): Redis would hand "
        "a running delivery to another worker. Raise broker_transport_options"
        f"['visibility_timeout'] above {floor:g}, or leave it unset and the outbox sets one"
    )


def check_worker_settings(
    cfg: OutboxConfig,
    conf: Any,
    *,
    delivery_queues: Collection[str],
    dsn_exposed: bool,
    pool: str | None = None,
    concurrency: int | None = None,
    queues: Collection[str] | None = None,
) -> list[str]:
    """Warnings for the Celery configuration ``conf`` of a worker serving outbox ``cfg`` (logged).

    :param delivery_queues: the outbox's delivery queues.
    :param dsn_exposed: whether a DSN with a password sits in the Celery configuration.
    :param pool: the worker's pool (``prefork``, ``solo``, ``threads``, ``gevent``...).
    :param concurrency: the worker's concurrency.
    :param queues: the queues the worker consumes; the pool checks only concern workers that
        consume a delivery queue (not, say, a solo worker on the claim queue alone).
    """
    problems = []
    if (conf.worker_prefetch_multiplier or 0) > 4:
        problems.append(
            f"worker_prefetch_multiplier={conf.worker_prefetch_multiplier}: reserved deliveries "
            "wait in the worker while their lease runs; use 1"
        )
    redelivery = redelivery_problem(cfg, conf)
    if redelivery:
        problems.append(redelivery)
    if conf.task_time_limit and conf.task_time_limit >= cfg.lease:
        problems.append(
            f"task_time_limit={conf.task_time_limit}s is not below the lease ({cfg.lease}s); "
            "outbox deliveries use their own limit below the lease"
        )
    if dsn_exposed:
        problems.append(
            "outbox_dsn or outbox_listen_dsn in the Celery configuration holds a password, and "
            "`celery report` and "
            "`celery inspect conf` print it (Celery masks only setting names it knows): set "
            f"{DSN_ENV} in the environment, pass Outbox(app, dsn=...), or keep the password in "
            "PGPASSWORD or a passfile"
        )
    delivers = queues is None or bool(set(queues) & set(delivery_queues))
    if delivers:
        problems += _pool_problems(cfg, conf, pool, concurrency)
    for p in problems:
        logger.warning("outbox settings: %s", p)
    return problems


def _pool_problems(cfg: OutboxConfig, conf: Any, pool: str | None, concurrency: int | None) -> list[str]:
    """What a worker that consumes a delivery queue should not run with: its pool's kind."""
    problems = []
    kind = (pool or "").split(":", 1)[0].rsplit(".", 1)[-1].lower()
    if kind in _POOLS_WITHOUT_TIME_LIMITS:
        problems.append(
            f"the {kind} pool does not enforce task time limits: a handler may outlive its "
            f"lease ({cfg.lease}s), be delivered again elsewhere, and its own finalize is then "
            "fenced off (lost lease); keep handlers well below the lease or extend it"
        )
    if kind == "solo" and str(conf.broker_url or "").startswith(("amqp", "pyamqp")):
        problems.append(
            "the solo pool on RabbitMQ can sit idle for seconds between late-acked messages "
            "(seen with Celery 5.7), so deliveries may expire before they start; use prefork "
            "for delivery queues (a solo worker on the claim queue alone is fine)"
        )
    if kind == "solo" and concurrency and concurrency > 1:
        problems.append(
            f"the solo pool runs one task at a time but prefetches concurrency ({concurrency}) "
            "x worker_prefetch_multiplier messages: deliveries wait behind the running one "
            "while their leases run (and RabbitMQ hands them to this worker, not an idle "
            "one); start it with -c 1"
        )
    if kind in _POOLS_SHARING_ONE_PROCESS and concurrency and concurrency > cfg.pool_max_size:
        problems.append(
            f"pool_max_size={cfg.pool_max_size} is below the {kind} pool's concurrency "
            f"({concurrency}): its tasks share one connection pool and would wait for it"
        )
    return problems
