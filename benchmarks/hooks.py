"""Worker-side instrumentation shared by the bare and the outbox Celery apps.

Configured through environment variables set by the benchmark runner:

* ``BENCH_COUNTER``: path of the :class:`~benchmarks.counter.CompletionCounter` file; every
  finished task is counted in ``task_postrun``.
* ``BENCH_READY``: a file written once the worker is ready to consume.
* ``BENCH_CLAIM_COUNTER``: a line per claim task run (claims that went through the broker).
* ``BENCH_LATENCY_DIR``: handlers append ``"<id> <time.time()>"`` lines here (latency runs only).
* ``BENCH_SPANS_DIR``: handlers append ``"<id> <start> <end>"`` lines here (``time.time()``,
  the machine's one wall clock), one file per process (the flow benchmark).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import IO, Any

from celery import Celery, signals

from .counter import CompletionCounter

__all__ = ["celery_app", "install", "record_published", "record_span", "record_start", "time_publish"]

_counter: CompletionCounter | None = None
_latency_file: IO[str] | None = None
_latency_pid = 0
_spans_file: IO[str] | None = None
_spans_pid = 0


def _on_postrun(sender: Any = None, args: Any = None, **kwargs: Any) -> None:
    # Deliveries only: on the README deployment claim tasks run in the same worker.
    name = str(getattr(sender, "name", ""))
    if _counter is not None and not name.endswith((".claim", ".purge")):
        # A batch task finishes as many messages as its first argument lists.
        n = len(args[0]) if name.endswith(".deliver_batch") and args else 1
        _counter.hit(time.time(), n)


def _on_prerun(sender: Any = None, **kwargs: Any) -> None:
    # Claim tasks that came through the broker (beat's, or the push_broker variant's).
    path = os.environ.get("BENCH_CLAIM_COUNTER")
    if path and str(getattr(sender, "name", "")).endswith(".claim"):
        with open(path, "a") as f:
            f.write(f"{time.time():.6f}\n")


def _on_ready(**kwargs: Any) -> None:
    ready = os.environ.get("BENCH_READY")
    if ready:
        Path(ready).write_text(str(os.getpid()))


def celery_app(name: str) -> Celery:
    """The benchmarks' outbox worker app: ``BENCH_BROKER_URL``, prefetch ``BENCH_PREFETCH`` (1),
    no results, no task events, no beat schedule of Celery's own (the Outbox adds its entries)."""
    app = Celery(name, broker=os.environ.get("BENCH_BROKER_URL", "memory://"))
    app.conf.update(
        worker_prefetch_multiplier=int(os.environ.get("BENCH_PREFETCH", "1")),
        task_ignore_result=True,
        worker_send_task_events=False,
        broker_connection_retry_on_startup=True,
        beat_schedule={},
    )
    return app


def install() -> None:
    """Connect the signals (idempotent; call at import of a benchmark app module)."""
    global _counter
    path = os.environ.get("BENCH_COUNTER")
    if path and _counter is None:
        _counter = CompletionCounter(path)
    signals.task_postrun.connect(_on_postrun, weak=False, dispatch_uid="bench-postrun")
    signals.task_prerun.connect(_on_prerun, weak=False, dispatch_uid="bench-prerun")
    signals.worker_ready.connect(_on_ready, weak=False, dispatch_uid="bench-ready")


def record_start(outbox_id: int) -> None:
    """Note when a handler started, for the commit -> handler start latency."""
    global _latency_file, _latency_pid
    folder = os.environ.get("BENCH_LATENCY_DIR")
    if not folder:
        return
    now = time.time()
    if _latency_file is None or _latency_pid != os.getpid():
        _latency_pid = os.getpid()
        _latency_file = open(Path(folder) / f"start-{_latency_pid}.txt", "a", buffering=1)  # noqa: SIM115
    _latency_file.write(f"{outbox_id} {now:.6f}\n")


def record_span(outbox_id: int, started: float, finished: float) -> None:
    """Note a handler run's start and end (``time.time()``; flow runs only)."""
    global _spans_file, _spans_pid
    folder = os.environ.get("BENCH_SPANS_DIR")
    if not folder:
        return
    if _spans_file is None or _spans_pid != os.getpid():
        _spans_pid = os.getpid()
        _spans_file = open(Path(folder) / f"spans-{_spans_pid}.txt", "a", buffering=1)  # noqa: SIM115
    _spans_file.write(f"{outbox_id} {started:.6f} {finished:.6f}\n")


def record_published(ids: list[int]) -> None:
    """Note when a claim run finished publishing ``ids`` (latency runs only)."""
    folder = os.environ.get("BENCH_LATENCY_DIR")
    if not folder or not ids:
        return
    now = time.time()
    with open(Path(folder) / f"published-{os.getpid()}.txt", "a") as f:
        f.write("".join(f"{i} {now:.6f}\n" for i in ids))


def time_publish(outbox: Any) -> None:
    """Benchmark-only: wrap ``outbox.publish`` to note publish times in latency runs."""
    if not os.environ.get("BENCH_LATENCY_DIR"):
        return
    publish = outbox.publish

    def timed(claims: Any) -> Any:
        result = publish(claims)
        record_published([c.id for c in result.sent])
        return result

    outbox.publish = timed
