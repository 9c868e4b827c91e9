"""A completion counter shared by every worker process through a memory-mapped file.

Both pipelines (bare Celery and the outbox) count a task as finished in Celery's
``task_postrun`` signal, after the task body returned (for the outbox: after the fenced finalize
committed). Counting costs one ``struct.pack_into`` on shared memory, no broker or database round
trip, so it does not tilt the comparison. Each process owns one slot (claimed under a file lock
on first use); the benchmark sums the counts and takes the latest completion time.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from pathlib import Path

__all__ = ["CompletionCounter"]

_SLOTS = 256
# pid, completed tasks, wall-clock time of the latest completion (time.time()).
_RECORD = struct.Struct("=qqd")


class CompletionCounter:
    """Per-process completion slots in one file; see the module docstring."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, _SLOTS * _RECORD.size)
        self._slot: int | None = None
        self._pid = 0
        self._count = 0

    @classmethod
    def create(cls, path: str | os.PathLike[str]) -> CompletionCounter:
        """Create (or reset) the file and open it."""
        Path(path).write_bytes(b"\0" * (_SLOTS * _RECORD.size))
        return cls(path)

    def _claim_slot(self) -> int:
        pid = os.getpid()
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            for slot in range(_SLOTS):
                owner, _, _ = _RECORD.unpack_from(self._map, slot * _RECORD.size)
                if owner in (0, pid):
                    _RECORD.pack_into(self._map, slot * _RECORD.size, pid, 0, 0.0)
                    return slot
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        raise RuntimeError("completion counter is full")

    def hit(self, now: float, n: int = 1) -> None:
        """Count ``n`` completed messages of this process (one task, or a batch task's rows),
        finished at ``now`` (``time.time()``)."""
        if self._slot is None or self._pid != os.getpid():
            self._slot = self._claim_slot()
            self._pid = os.getpid()
            self._count = 0
        self._count += n
        _RECORD.pack_into(self._map, self._slot * _RECORD.size, self._pid, self._count, now)

    def read(self) -> tuple[int, float]:
        """``(completed tasks, latest completion time)`` over every process."""
        total = 0
        latest = 0.0
        for slot in range(_SLOTS):
            pid, count, last = _RECORD.unpack_from(self._map, slot * _RECORD.size)
            if pid:
                total += count
                latest = max(latest, last)
        return total, latest

    def close(self) -> None:
        """Unmap and close the file."""
        self._map.close()
        os.close(self._fd)
