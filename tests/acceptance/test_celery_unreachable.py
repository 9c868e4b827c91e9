"""A worker that cannot reach its database says so by exiting (``unreachable_exit_after``).

A real worker runs the push listener against PostgreSQL through a TCP proxy; the proxy stops
(every connection closed, new ones refused), as when the database host goes away. With the
setting, the worker stops itself (warm shutdown, exit code 1) once the bound has passed, so a
supervisor restarts it and a probe sees it; without it, it keeps logging ``reconnecting``.
"""

from __future__ import annotations

import time

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from support.processes import wait_until
from support.tcp_proxy import FreezableProxy

from acceptance.conftest import HarnessFactory

pytestmark = pytest.mark.slow

BOUND = 3.0


def test_a_worker_whose_database_stays_unreachable_exits_with_code_1_after_the_bound(
    harness_factory: HarnessFactory, redis_url: str
) -> None:
    h = harness_factory(redis_url)
    params = conninfo_to_dict(h.dsn)
    proxy = FreezableProxy((str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432)))
    try:
        h.spec.dsn = make_conninfo(h.dsn, host="127.0.0.1", port=proxy.port)
        h.configure(unreachable_exit_after=BOUND, listen_poll=0.2)
        worker = h.worker(pool="solo")
        worker.wait_for_log("listening on", timeout=30)
        h.enqueue(2)
        h.wait_finished(2)  # delivered through the proxy: the worker works
        proxy.close()  # the database goes away
        gone = time.monotonic()
        wait_until(lambda: not worker.alive(), 60, lambda: f"worker still running:\n{worker.log()[-3000:]}")
        took = time.monotonic() - gone
    finally:
        proxy.close()
    assert worker.popen.returncode == 1, worker.log()[-3000:]
    log = worker.log()
    assert "reconnecting in" in log
    assert f"(unreachable_exit_after {BOUND:.1f}s)" in log and "stopping the worker" in log
    assert took >= BOUND, took


def test_a_worker_whose_database_is_unreachable_at_start_refuses_to_start_in_one_line(
    harness_factory: HarnessFactory, redis_url: str
) -> None:
    h = harness_factory(redis_url)
    proxy = FreezableProxy(("127.0.0.1", 9))
    proxy.close()  # nothing listens on its port: connections are refused
    h.spec.dsn = make_conninfo(h.dsn, host="127.0.0.1", port=proxy.port, password="s3cret-pw")
    h.configure()
    started = time.monotonic()
    worker = h.worker(pool="solo", wait=False)
    wait_until(lambda: not worker.alive(), 60, lambda: f"worker still running:\n{worker.log()[-3000:]}")
    assert time.monotonic() - started < 30
    assert worker.popen.returncode == 1, worker.log()[-3000:]
    log = worker.log()
    lines = [line for line in log.splitlines() if "the worker does not start" in line]
    assert len(lines) == 1, log[-3000:]
    assert "Connection refused" in lines[0] and "outbox_wait_for_database" in lines[0]
    assert "s3cret-pw" not in log
    assert "ready." not in log  # it never consumed a task


def test_a_worker_refuses_to_start_on_a_table_that_was_never_migrated(
    harness_factory: HarnessFactory, redis_url: str
) -> None:
    h = harness_factory(redis_url)
    h.configure(table="never_migrated")
    worker = h.worker(pool="solo", wait=False)
    wait_until(lambda: not worker.alive(), 60, lambda: f"worker still running:\n{worker.log()[-3000:]}")
    assert worker.popen.returncode == 1, worker.log()[-3000:]
    assert "table never_migrated was never migrated: run `outbox-celery migrate`" in worker.log()


def test_with_wait_for_database_a_worker_starts_once_its_database_answers(
    harness_factory: HarnessFactory, redis_url: str
) -> None:
    h = harness_factory(redis_url)
    params = conninfo_to_dict(h.dsn)
    proxy = FreezableProxy((str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432)))
    try:
        proxy.freeze()  # connections are accepted and answered by nothing: a host that hangs
        h.spec.dsn = make_conninfo(h.dsn, host="127.0.0.1", port=proxy.port)
        h.configure(wait_for_database=60)
        ids = h.enqueue(2)
        worker = h.worker(pool="solo", wait=False)
        worker.wait_for_log("waiting for the database before starting", timeout=30)
        assert worker.alive()
        proxy.thaw()
        worker.wait_for_log("ready.", timeout=60)
        h.beat()
        h.wait_finished(len(ids))
    finally:
        proxy.close()
