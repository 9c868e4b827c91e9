"""Prometheus metrics of an outbox: the table's gauges, an exporter, and the workers' delivery
counters (docs/operations.md, "Metrics").

::

    from prometheus_client import REGISTRY
    from outbox_celery.metrics import OutboxCollector, track_deliveries

    REGISTRY.register(OutboxCollector.from_outbox(outbox))  # the table's gauges
    track_deliveries(outbox)  # in the module the workers load: deliveries per outcome

The gauges are read from the database (:mod:`outbox_celery.ops.metrics`, no Celery); the
counters are counted in the workers (:mod:`outbox_celery.app.metrics`).
"""

from __future__ import annotations

from .app.metrics import track_deliveries
from .ops.metrics import DEFAULT_METRICS_CAP, DEFAULT_PORT, METRIC_KEYS, OutboxCollector, start_exporter

__all__ = [
    "DEFAULT_METRICS_CAP",
    "DEFAULT_PORT",
    "METRIC_KEYS",
    "OutboxCollector",
    "start_exporter",
    "track_deliveries",
]
