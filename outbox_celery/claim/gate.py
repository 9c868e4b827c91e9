"""The claim gate: a process's push claim runs over several databases, one at a time, in order.

An Outbox of several databases runs one push listener per database in the claim worker's main
process, which is also Celery's consumer. Each claim run there is Python between short
statements; twenty of them at once keep the consumer's thread from the interpreter lock, so
published tasks wait in the broker while the pool processes sit idle (DESIGN invariant 35
has the measurements). The gate lets one run in at a time, in arrival order, which also hands
the databases their turns round robin. A run that takes longer than ``patience`` (a database that
does not answer, a hot one's long run) lets the next one in beside it, so no database waits
on another's for longer than that.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["PATIENCE", "ClaimGate", "until_slot"]

#: Seconds a claim run holds the gate alone before the next one may enter beside it.
PATIENCE = 0.05


def until_slot(now: float, period: float, phase: float) -> float:
    """Seconds from ``now`` to the next of the moments ``phase + k * period`` that is at least
    half a period away: each idle database's sweep keeps a moment of its own in the period, so
    a hundred idle databases are swept one after another rather than all at once (a sweep that
    connects afresh holds the gate for a connection's setup)."""
    wait = period - ((now - phase) % period)
    return wait + period if wait < period / 2 else wait


class ClaimGate:
    """One claim run at a time, first come first served; a run past ``patience`` seconds lets
    the next one in beside it (and so on, one more per ``patience``)."""

    def __init__(self, patience: float = PATIENCE) -> None:
        self.patience = patience
        self._lock = threading.Lock()
        # The runs waiting, each by the event that wakes it, the head first.
        self._waiting: deque[threading.Event] = deque()
        # The runs inside: ticket -> when it entered (monotonic).
        self._inside: dict[int, float] = {}
        self._tickets = 0

    def _left(self, now: float) -> float:
        """Seconds until the next run may enter (0: now): every run inside is past patience."""
        if not self._inside:
            return 0.0
        return self.patience - (now - max(self._inside.values()))

    def _enter(self, now: float) -> int:
        self._tickets += 1
        self._inside[self._tickets] = now
        return self._tickets

    def _wait(self, me: threading.Event) -> int | None:
        """One wait in line: the ticket once this run may enter, else ``None``."""
        timeout: float | None = None
        with self._lock:
            if self._waiting[0] is me:
                now = time.monotonic()
                left = self._left(now)
                if left <= 0:
                    self._waiting.popleft()
                    if self._waiting:  # the next head starts its own wait for patience
                        self._waiting[0].set()
                    return self._enter(now)
                timeout = left
            me.clear()
        me.wait(timeout)
        return None

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Wait for this run's turn; the block is the run."""
        me = threading.Event()
        with self._lock:
            now = time.monotonic()
            ticket = None if self._waiting or self._left(now) > 0 else self._enter(now)
            if ticket is None:
                self._waiting.append(me)
        try:
            while ticket is None:
                ticket = self._wait(me)
        except BaseException:  # interrupted while waiting: leave the line, wake the next head
            with self._lock:
                if me in self._waiting:
                    self._waiting.remove(me)
                if self._waiting:
                    self._waiting[0].set()
            raise
        try:
            yield
        finally:
            with self._lock:
                del self._inside[ticket]
                if self._waiting:
                    self._waiting[0].set()
