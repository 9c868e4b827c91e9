"""A worker process's fenced ``done`` writes, batched (River's batch completer does this).

A handled unordered message's ``done`` waits up to ``done_batch_delay`` in its worker process,
then goes out with the others of that window in one fenced statement
(the completer's ``finish`` with a ``done`` per row): one round trip and one commit for many rows
instead of one each.

The crash window, and why it keeps invariants 4 and 10 (docs/design.md, "Batched done"): the
Celery message is acknowledged when the task returns, before its ``done`` is written. A process
killed inside the window leaves the row ``processing`` under a lease whose claim started; once
the lease ends the next claim takes it again and the handler runs once more (at least once,
invariant 11; never lost, invariant 10). Nothing else can finish the row meanwhile: a live lease
is never re-claimed (invariant 2), and operators' commands refuse live leases. Each row of a
batch is fenced on its own ``lease_version``: a row whose lease was lost is left alone and
counted as a lost lease (invariant 4). The deliverer batches only while the lease has room for
the delay (:data:`~outbox_celery.worker.deliverer.DONE_BATCH_MARGIN`), so a write in the window finds
its fence unless the database refused it; ordered rows never wait (their done moves the key's
head, invariant 9).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable

from ..db.completer import Lease

__all__ = ["DoneBatcher"]

logger = logging.getLogger(__name__)

# A batch never holds more rows than this; a full batch is written at once.
MAX_ROWS = 500

Finished = Lease


class DoneBatcher:
    """Collects the :class:`~outbox_celery.db.completer.Lease` of handled rows and writes them together.

    :param write: the fenced write of one batch (the deliverer's, which retries on a broken
        connection); returns the ids that went ``done``.
    :param delay: seconds the first row of a batch may wait before the batch is written.
    :param max_rows: rows after which a batch is written at once.
    """

    def __init__(
        self, write: Callable[[list[Finished]], object], *, delay: float, max_rows: int = MAX_ROWS
    ) -> None:
        self._write = write
        self.delay = delay
        self.max_rows = max_rows
        self._cond = threading.Condition()
        self._pending: list[Finished] = []
        self._first = 0.0
        self._thread: threading.Thread | None = None
        self._closing = False
        # A fork may happen while the writer thread holds the lock, and the child has no such
        # thread: it starts afresh, and the rows queued before the fork stay the parent's.
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _after_fork(ref))

    def add(self, outbox_id: int, lease_version: int) -> None:
        """Queue one handled row's ``done``; written within ``delay`` seconds."""
        full: list[Finished] = []
        with self._cond:
            if not self._pending:
                self._first = time.monotonic()
            self._pending.append(Lease(outbox_id, lease_version))
            if len(self._pending) >= self.max_rows:
                full, self._pending = self._pending, []
            elif self._thread is None or not self._thread.is_alive():
                self._closing = False
                self._thread = threading.Thread(target=self._run, name="outbox-done-batch", daemon=True)
                self._thread.start()
            else:
                self._cond.notify()
        self._flush(full)  # a full batch is written at once, by the caller

    def pending(self) -> int:
        """Rows of this process waiting to be written."""
        with self._cond:
            return len(self._pending)

    def flush(self) -> None:
        """Write what is waiting now, in the calling thread (worker shutdown, tests)."""
        with self._cond:
            batch, self._pending = self._pending, []
        self._flush(batch)

    def close(self, timeout: float = 5.0) -> None:
        """Write what is waiting and stop the writer thread (idempotent)."""
        with self._cond:
            self._closing = True
            thread, self._thread = self._thread, None
            self._cond.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self.flush()

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._pending = []
        self._thread = None
        self._closing = False

    def _run(self) -> None:
        # The wait for the first row is untimed and the window a plain sleep: a timed wait on a
        # condition measures an absolute deadline, which a process under a shifted clock
        # (libfaketime in the tests, invariant 13) would stretch by the shift.
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                first, closing = self._first, self._closing
            remaining = first + self.delay - time.monotonic()
            if remaining > 0 and not closing:
                time.sleep(remaining)
            with self._cond:
                batch, self._pending = self._pending, []
                closing = self._closing
            self._flush(batch)
            if closing:
                return

    def _flush(self, batch: list[Finished]) -> None:
        if not batch:
            return
        try:
            self._write(batch)
        except Exception:
            # Still processing, under started leases: the next claim after their lease takes
            # them again (a redelivery, never a loss).
            logger.exception(
                "outbox: writing done for %s row(s) failed; they are delivered again after their lease",
                len(batch),
                extra={"outcome": "done_batch_failed", "rows": len(batch)},
            )


def _after_fork(ref: weakref.ref[DoneBatcher]) -> None:
    batcher = ref()
    if batcher is not None:
        batcher._reset()
