"""The app of ``python -m benchmarks.databases``: one Outbox over several databases, no-op handler.

Configured by the runner through ``BENCH_*`` environment variables:

* ``BENCH_DATABASES``: JSON, database name -> DSN (``Outbox(databases=...)``); empty or unset:
  ``BENCH_DSN``, one database (``Outbox(dsn=...)``, the baseline).
* ``BENCH_BROKER_URL``, ``BENCH_CLAIM_QUEUE``, ``BENCH_QUEUE``, ``BENCH_PREFETCH``.
* ``BENCH_OUTBOX_SETTINGS``: JSON, more Outbox settings (``lease``, ``claim_interval``,
  ``idle_sweep``...; the library's defaults for the others).
* ``BENCH_LATENCY_DIR``: the handler appends ``"<database> <id> <time.time()>"`` at its start,
  one file per process (the producer notes each commit the same way: one machine, one clock);
  a claim run notes when it published each row the same way (``published-<pid>.txt``: the
  worker's main process is its listeners', a pool process's is beat's claim task).
* ``BENCH_CLAIM_LOG``: a ``"<pid> <time.time()>"`` line per claim task (beat's, through the
  broker), so the runner knows which processes claimed; ``BENCH_CLAIM_LOG.done`` a
  ``"<pid> <start> <end>"`` line per claim task that returned (one killed at its time limit
  has none), so it knows how long they held a pool process.
* ``BENCH_READY``: written once the worker is ready (:mod:`benchmarks.hooks`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import IO, Any

from celery import signals

from outbox_celery import Message
from outbox_celery.app.outbox import Outbox

from . import hooks

app = hooks.celery_app("bench_databases")

DATABASES: dict[str, str] = json.loads(os.environ.get("BENCH_DATABASES") or "{}")
_where: dict[str, Any] = {"databases": DATABASES} if DATABASES else {"dsn": os.environ.get("BENCH_DSN")}
outbox = Outbox(
    app,
    name="bench",
    claim_queue=os.environ.get("BENCH_CLAIM_QUEUE", "bench.claim"),
    default_queue=os.environ.get("BENCH_QUEUE", "bench.deliver"),
    retention=None,
    **_where,
    **json.loads(os.environ.get("BENCH_OUTBOX_SETTINGS") or "{}"),
)

_files: dict[tuple[str, int], IO[str]] = {}


def _record(kind: str, database: str, ids: list[int]) -> None:
    """Append ``"<database> <id> <time.time()>"`` lines to this process's ``<kind>-<pid>.txt``."""
    folder = os.environ.get("BENCH_LATENCY_DIR")
    if not folder or not ids:
        return
    now = time.time()
    key = (kind, os.getpid())
    out = _files.get(key)
    if out is None:
        # One file per process and kind; a forked child opens its own (its pid differs).
        out = _files[key] = open(Path(folder) / f"{kind}-{key[1]}.txt", "a", buffering=1)  # noqa: SIM115
    out.write("".join(f"{database} {i} {now:.6f}\n" for i in ids))


def record_start(database: str, outbox_id: int) -> None:
    """Note when a handler started (``time.time()``), for commit -> handler start per database."""
    _record("start", database, [outbox_id])


_publish = outbox.publish


def _timed_publish(claims: Any, database: str | None = None) -> Any:
    result = _publish(claims, database)
    _record("published", database or "-", [c.id for c in result.sent])
    return result


if os.environ.get("BENCH_LATENCY_DIR"):
    outbox.publish = _timed_publish  # type: ignore[method-assign]


@outbox.handler("bench.noop")
def noop(message: Message) -> None:
    """Do nothing; note the start, under the message's database (``-``: the one ``dsn``)."""
    record_start(message.database or "-", message.id)


_claim_started: dict[str, float] = {}


def _on_prerun(sender: Any = None, task_id: str = "", **kwargs: Any) -> None:
    path = os.environ.get("BENCH_CLAIM_LOG")
    if path and str(getattr(sender, "name", "")).endswith(".claim"):
        now = time.time()
        _claim_started[task_id] = now
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {now:.6f}\n")


def _on_postrun(sender: Any = None, task_id: str = "", **kwargs: Any) -> None:
    """``"<pid> <start> <end>"`` in ``BENCH_CLAIM_LOG.done`` per claim task that returned."""
    path = os.environ.get("BENCH_CLAIM_LOG")
    started = _claim_started.pop(task_id, None)
    if path and started is not None:
        with open(f"{path}.done", "a") as f:
            f.write(f"{os.getpid()} {started:.6f} {time.time():.6f}\n")


signals.task_prerun.connect(_on_prerun, weak=False, dispatch_uid="bench-databases-claims")
signals.task_postrun.connect(_on_postrun, weak=False, dispatch_uid="bench-databases-claims-done")
hooks.install()
