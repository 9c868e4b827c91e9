"""Worker-side operations in real processes: delivery counters and the retention task.

The delivery counters (:func:`outbox_celery.metrics.track_deliveries`) are counted in a real
prefork worker in prometheus_client's multiprocess mode and served by the real exporter
(``outbox-celery metrics --worker-metrics-dir``). The retention task runs in a real worker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql

from acceptance.conftest import Harness
from outbox_celery import TableName
from outbox_celery.testing import free_port

SETTLE = 90.0  # seconds; bounds waiting on a loaded machine, never asserts speed

TRACKING_MODULE = """
from support.worker_app import outbox

from outbox_celery.metrics import track_deliveries

track_deliveries(outbox)
"""


def _scrape_until(
    port: int, proc: subprocess.Popen[bytes], log: Path, ready: Any
) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    deadline = time.monotonic() + SETTLE
    last: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
                text = response.read().decode()
            last = {
                (s.name, frozenset(s.labels.items())): s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples
            }
            if ready(last):
                return last
        except (urllib.error.URLError, ConnectionError):
            if proc.poll() is not None:
                break
        time.sleep(0.2)
    raise AssertionError(f"exporter never showed the expected samples; last: {last}\n{log.read_text()}")


@pytest.mark.slow
@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
def test_delivery_outcomes_are_counted_per_event_type_in_a_prefork_worker(
    harness: Harness, tmp_path: Path
) -> None:
    prom_dir = tmp_path / "prom"
    prom_dir.mkdir()
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "outbox_track_deliveries.py").write_text(textwrap.dedent(TRACKING_MODULE))
    harness.configure(
        routes={"order.created": None, "order.rejected": None},
        celery={"imports": ["outbox_track_deliveries"]},
    )
    harness.enqueue(3, event_type="order.created")
    harness.enqueue(2, event_type="order.rejected", payload={"mode": "permanent"})
    env = {**harness.spec.env(), "PYTHONPATH": str(modules), "PROMETHEUS_MULTIPROC_DIR": str(prom_dir)}
    harness.procs.worker(harness.queues, env=env, concurrency=2)
    harness.procs.beat(env={**harness.spec.env(), "PYTHONPATH": str(modules)})
    harness.wait_finished(5, statuses_=("done", "dead"))

    port = free_port()
    log = tmp_path / "exporter.log"
    with log.open("wb") as out:
        exporter = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "outbox_celery",
                "--table",
                harness.table,
                "metrics",
                "--port",
                str(port),
                "--addr",
                "127.0.0.1",
                "--worker-metrics-dir",
                str(prom_dir),
            ],
            env={**os.environ, "OUTBOX_DSN": harness.dsn},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        table = harness.table

        def counted(samples: dict[tuple[str, frozenset[tuple[str, str]]], float]) -> bool:
            done = (
                "outbox_deliveries_total",
                frozenset({"table": table, "event_type": "order.created", "outcome": "done"}.items()),
            )
            dead = (
                "outbox_deliveries_total",
                frozenset({"table": table, "event_type": "order.rejected", "outcome": "dead"}.items()),
            )
            return samples.get(done) == 3 and samples.get(dead) == 2

        samples = _scrape_until(port, exporter, log, counted)
        # The database-side gauges are served alongside.
        assert samples[("outbox_messages", frozenset({"table": table, "status": "dead"}.items()))] == 2
        assert samples[("outbox_messages", frozenset({"table": table, "status": "done"}.items()))] == 3
        outcomes = {
            dict(labels)["outcome"] for (name, labels) in samples if name == "outbox_deliveries_total"
        }
        assert outcomes == {"done", "dead"}
    finally:
        if exporter.poll() is None:
            os.killpg(exporter.pid, signal.SIGKILL)
        exporter.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
def test_retention_task_runs_in_a_real_worker(harness: Harness) -> None:
    harness.configure(retention=3600.0, retention_batch_size=2)
    old = harness.enqueue(5)
    recent = harness.enqueue(2)
    keep = harness.enqueue(1)
    table = TableName.parse(harness.table).identifier()
    for ids, assignments in [
        (old, "status = 'done', done_at = now() - interval '2 hours'"),
        (recent, "status = 'done', done_at = now() - interval '5 minutes'"),
        (keep, "status = 'dead', created_at = now() - interval '30 days'"),
    ]:
        harness.conn.execute(
            sql.SQL("UPDATE {} SET " + assignments + " WHERE id = ANY(%s)").format(table), [ids]
        )
    # The beat entry the worker's app installs (its first run is one interval away, so the
    # test sends the same task itself).
    entry = harness.app.conf.beat_schedule["outbox-purge"]
    assert entry["task"] == harness.outbox.purge_task.name
    harness.worker(queues=[harness.claim_queue], concurrency=1)
    harness.outbox.purge_task.apply_async(**entry["options"])
    harness.wait(lambda: len(harness.rows()) == 3, what="old done rows purged")
    assert sorted(r["id"] for r in harness.rows()) == sorted(recent + keep)
