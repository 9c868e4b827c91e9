"""Worker-side delivery counters: ``<namespace>_deliveries_total`` per event type and outcome.

Counted from Celery's ``task_postrun`` signal in the worker process that ran the delivery task;
the exporter (:func:`outbox_celery.ops.metrics.start_exporter`) serves them beside the table's
gauges. Public as :func:`outbox_celery.metrics.track_deliveries`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..ops.metrics import require_prometheus

if TYPE_CHECKING:
    from prometheus_client import Counter
    from prometheus_client.registry import CollectorRegistry

    from .outbox import Outbox

__all__ = ["track_deliveries"]


def track_deliveries(
    outbox: Outbox, *, registry: CollectorRegistry | None = None, namespace: str = "outbox"
) -> Counter:
    """Count the deliveries this worker finishes: ``<namespace>_deliveries_total``.

    Optional and worker-side: call it in the module your workers load (after the
    :class:`~outbox_celery.app.outbox.Outbox` is built). Labels: ``table``, ``event_type`` and
    ``outcome``, the delivery task's result (``done``, ``retry``, ``defer``, ``dead``,
    ``stale``, ``lost_lease``, ``unroutable``) or ``error`` when the handler raised something
    unclassified. ``lost_lease`` is the fencing at work: a finalize that came too late. A batch
    task (``batch=`` handlers, docs/batch.md) counts each of its rows under its own outcome.

    A prefork worker counts in each pool process: run the worker with
    ``PROMETHEUS_MULTIPROC_DIR`` set (an empty directory, before it starts) and serve the
    counters with ``outbox-celery metrics --worker-metrics-dir DIR`` on the same machine (or
    your own ``MultiProcessCollector``). With ``--pool solo`` or threads, registering into a
    registry you already serve is enough.
    """
    require_prometheus()
    from celery import signals
    from prometheus_client import REGISTRY
    from prometheus_client import Counter as _Counter

    counter = _Counter(
        f"{namespace}_deliveries",
        "Outbox deliveries finished by workers, per event type and outcome.",
        ["table", "event_type", "outcome"],
        registry=registry if registry is not None else REGISTRY,
    )
    task_name = outbox.deliver_task.name
    batch_name = outbox.deliver_batch_task.name

    def on_postrun(
        sender: Any = None,
        task: Any = None,
        retval: Any = None,
        state: str | None = None,
        args: Any = None,
        **kwargs: Any,
    ) -> None:
        task = task or sender
        name = getattr(task, "name", None)
        if name not in (task_name, batch_name):
            return
        # The publisher puts the event type in a message header, which Celery exposes on the
        # request; the task's arguments are only (id, lease_version).
        event_type = getattr(getattr(task, "request", None), "outbox_event_type", None) or "unknown"
        labels = (outbox.config.table.qualified, str(event_type))
        if name == task_name:
            outcome = str(retval) if state == "SUCCESS" else "error"
            counter.labels(*labels, outcome).inc()
        elif state == "SUCCESS" and isinstance(retval, Mapping):
            # A batch task returns how many of its rows ended in each outcome.
            for outcome, n in retval.items():
                counter.labels(*labels, str(outcome)).inc(int(n))
        else:
            # It raised: every row of the batch counts as an error (they return after the lease).
            counter.labels(*labels, "error").inc(len(args[0]) if args else 1)

    signals.task_postrun.connect(on_postrun, weak=False)
    return counter
