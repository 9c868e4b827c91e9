"""The done batcher's timing and threading, with a recording write and no database.

What it promises the dispatcher: a row's ``done`` is written within ``delay`` of the first row of
its window, together with the window's other rows; a full batch goes out at once in the caller's
thread; a failed write is logged and the thread carries on (the rows come back through their
lease, DESIGN invariants 4 and 10); a forked child starts with nothing of its parent's.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from outbox_celery.worker.done_batch import DoneBatcher, Finished

# Bounds for a loaded 2-core machine: they bound waiting, never assert speed.
SETTLE = 10.0


class Recorder:
    """A write that records each batch, the thread that wrote it and when."""

    def __init__(self, fail: int = 0) -> None:
        self.batches: list[list[Finished]] = []
        self.threads: list[str] = []
        self.times: list[float] = []
        self.fail = fail
        self.written = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, batch: list[Finished]) -> None:
        with self._lock:
            if self.fail:
                self.fail -= 1
                raise OSError("connection lost")
            self.batches.append(list(batch))
            self.threads.append(threading.current_thread().name)
            self.times.append(time.monotonic())
        self.written.set()

    def wait(self, n: int = 1) -> None:
        deadline = time.monotonic() + SETTLE
        while len(self.batches) < n:
            assert time.monotonic() < deadline, f"{n} batch(es) expected, got {self.batches}"
            time.sleep(0.005)


Make = Callable[..., tuple[Recorder, DoneBatcher]]


@pytest.fixture
def make() -> Iterator[Make]:
    """``make(delay=..., max_rows=..., fail=...)``: a recording write and its batcher, closed after
    the test."""
    made: list[DoneBatcher] = []

    def build(*, fail: int = 0, **kwargs: Any) -> tuple[Recorder, DoneBatcher]:
        write = Recorder(fail=fail)
        made.append(DoneBatcher(write, **kwargs))
        return write, made[-1]

    yield build
    for batcher in made:
        batcher.close(timeout=1.0)


def test_rows_of_one_window_are_written_together_once_the_delay_has_passed(
    make: Make,
) -> None:
    write, batcher = make(delay=0.3)
    started = time.monotonic()
    for i in range(1, 4):
        batcher.add(i, 10 + i)
    assert batcher.pending() == 3
    write.wait()
    assert write.batches == [[(1, 11), (2, 12), (3, 13)]]
    assert write.threads == ["outbox-done-batch"]
    # The first row waited the window out, not longer than a loaded machine needs.
    assert 0.3 <= write.times[0] - started < 0.3 + SETTLE
    assert batcher.pending() == 0


def test_the_window_starts_at_the_first_row_of_each_batch(make: Make) -> None:
    write, batcher = make(delay=0.2)
    batcher.add(1, 1)
    write.wait(1)
    time.sleep(0.3)  # the writer thread idles, with no window open
    second = time.monotonic()
    batcher.add(2, 1)
    write.wait(2)
    assert write.batches == [[(1, 1)], [(2, 1)]]
    # A fresh window for the second batch: the idle time before it does not count.
    assert write.times[1] - second >= 0.2


def test_a_full_batch_is_written_at_once_in_the_callers_thread(make: Make) -> None:
    write, batcher = make(delay=3600.0, max_rows=3)
    batcher.add(1, 1)
    batcher.add(2, 1)
    assert write.batches == []
    batcher.add(3, 1)
    assert write.batches == [[(1, 1), (2, 1), (3, 1)]]
    assert write.threads == [threading.current_thread().name]
    assert batcher.pending() == 0


def test_flush_writes_what_waits_now_in_the_callers_thread(make: Make) -> None:
    write, batcher = make(delay=3600.0)
    batcher.add(1, 1)
    batcher.flush()
    assert write.batches == [[(1, 1)]]
    assert write.threads == [threading.current_thread().name]
    assert batcher.pending() == 0
    batcher.flush()  # nothing waits: nothing is written
    assert len(write.batches) == 1


def test_close_writes_what_waits_and_stops_the_thread() -> None:
    write = Recorder()
    batcher = DoneBatcher(write, delay=0.2)
    batcher.add(1, 1)
    thread = batcher._thread
    assert thread is not None and thread.is_alive()
    batcher.close(timeout=SETTLE)
    assert write.batches == [[(1, 1)]]
    assert not thread.is_alive()
    batcher.close()  # idempotent
    assert write.batches == [[(1, 1)]]
    batcher.add(2, 1)  # a closed batcher that is used again starts a new thread
    write.wait(2)
    batcher.close(timeout=SETTLE)
    assert write.batches == [[(1, 1)], [(2, 1)]]


def test_a_failed_write_is_logged_and_the_next_batch_still_goes_out(
    make: Make, caplog: pytest.LogCaptureFixture
) -> None:
    write, batcher = make(fail=1, delay=0.05)
    with caplog.at_level(logging.ERROR, logger="outbox_celery.worker.done_batch"):
        batcher.add(1, 1)
        deadline = time.monotonic() + SETTLE
        while write.fail:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        batcher.add(2, 1)
        write.wait()
    assert write.batches == [[(2, 1)]]
    [record] = [r for r in caplog.records if getattr(r, "outcome", None) == "done_batch_failed"]
    assert record.__dict__["rows"] == 1
    assert "delivered again after their lease" in record.getMessage()


def test_concurrent_adds_are_each_written_exactly_once(make: Make) -> None:
    write, batcher = make(delay=0.01, max_rows=7)

    def add(worker: int) -> None:
        for i in range(200):
            batcher.add(worker * 1000 + i, worker)

    threads = [threading.Thread(target=add, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    batcher.close(timeout=SETTLE)
    written = [row for batch in write.batches for row in batch]
    assert sorted(written) == sorted((w * 1000 + i, w) for w in range(4) for i in range(200))
    assert max(len(b) for b in write.batches) <= 7


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_starts_empty_and_the_parents_rows_stay_the_parents() -> None:
    write = Recorder()
    batcher = DoneBatcher(write, delay=0.5)
    batcher.add(1, 1)  # the parent's row, and its writer thread, waiting out the window
    read, out = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, never return into pytest
        code = 1
        try:
            ok = batcher.pending() == 0 and batcher._thread is None
            batcher.add(2, 2)
            batcher.flush()
            ok = ok and write.batches == [[(2, 2)]]
            code = 0 if ok else 1
        finally:
            os.write(out, bytes([code]))
            os._exit(code)
    os.close(out)
    assert os.read(read, 1) == b"\x00"
    os.close(read)
    os.waitpid(pid, 0)
    batcher.close(timeout=SETTLE)
    assert write.batches == [[(1, 1)]]  # written by the parent, and only its own row
