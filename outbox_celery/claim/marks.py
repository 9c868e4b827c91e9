"""Where one process's claims start their index scans (DESIGN invariant 18): :class:`ScanMarks`.

The claim's executor (:mod:`outbox_celery.claim.executor`) reads the marks before each scan and
moves them after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Protocol

__all__ = ["ScanMarks", "Taken"]


class Taken(Protocol):
    """A row a claiming statement took: when it was due."""

    @property
    def available_at(self) -> datetime:
        """When the row was due."""
        ...


class ScanMarks:
    """Where one process's claims start their index scans (DESIGN invariant 18).

    A claim steps over every index entry in front of the rows it takes. While a long transaction
    somewhere in the database pins the xmin horizon, VACUUM removes nothing, and the entries of
    rows claimed, started and finished since then stay in front of every scan: the claim slows as
    the pin lasts. The marks remember, per index, where this process's previous claim stopped
    (the database's ``now()`` when it took everything due, else the last row it took), and the
    next claim starts ``lookback`` seconds behind that, so what it steps over is bounded by the
    rows of ``lookback`` seconds, not by the age of the pin.

    A row can still appear behind a mark: one whose producer's transaction committed more than
    ``lookback`` after it began (``available_at`` is the transaction's ``now()``), or one that a
    concurrent transaction held locked. Every ``full_every`` seconds (and on a process's first
    claim) a claim scans from the start of each index instead, and takes those.

    Times are the database's (``now()`` and row values); only the full-pass period is measured
    on this process's monotonic clock, a duration.
    """

    __slots__ = (
        "bare",
        "db_now",
        "excluded",
        "expired",
        "full_at",
        "full_every",
        "full_passes",
        "heads",
        "keyed",
        "lookback",
        "pending",
        "typed",
    )

    def __init__(self, *, lookback: float = 10.0, full_every: float = 60.0) -> None:
        if lookback < 0 or full_every < 0:
            raise ValueError("lookback and full_every are seconds >= 0")
        self.lookback = lookback
        self.full_every = full_every
        self.pending: datetime | None = None
        self.heads: datetime | None = None
        self.expired: datetime | None = None
        #: Monotonic time of the last full pass; None before the first claim.
        self.full_at: float | None = None
        self.full_passes = 0
        #: Marks of the limited event types' own statements, by (scan, event type).
        self.typed: dict[tuple[str, str], datetime | None] = {}
        #: Event types the previous claim left out of every statement (paused, or held by a
        #: RateLimited outcome): their rows may lie behind the marks (DESIGN invariant 23).
        self.excluded: frozenset[str] = frozenset()
        #: Event types the previous claim took key by key: their keyed rows were left out of
        #: their own statements, whose marks moved past them (DESIGN invariant 25).
        self.keyed: frozenset[str] = frozenset()
        #: The database's now() of the previous claim.
        self.db_now: datetime | None = None
        #: The previous claim's fan-out of bare rows found a full batch: the next one goes on.
        self.bare = False

    def full_due(self, monotonic_now: float) -> bool:
        """Whether a claim that begins at ``monotonic_now`` is a full pass (:meth:`begin`)."""
        return self.full_at is None or not 0 <= monotonic_now - self.full_at < self.full_every

    def ahead(self, monotonic_now: float) -> tuple[datetime | None, datetime | None]:
        """The expired and heads scans' lower bounds of a claim that begins at ``monotonic_now``,
        read before it begins (its first statement probes both ranges); a clock check or a type
        readmitted can still make the claim a full pass, whose bounds are both None."""
        if self.full_due(monotonic_now):
            return None, None
        return self.since(self.expired), self.since(self.heads)

    def begin(self, monotonic_now: float) -> bool:
        """Start a claim: forget the marks when a full pass is due; return whether it is."""
        if self.full_due(monotonic_now):
            self.forget(monotonic_now)
            return True
        return False

    def forget(self, monotonic_now: float) -> None:
        """Make this claim a full pass: every scan starts at the beginning of its index."""
        self.pending = self.heads = self.expired = None
        self.typed.clear()
        self.full_at = monotonic_now
        self.full_passes += 1

    def check_clock(self, db_now: datetime, monotonic_now: float) -> None:
        """A full pass when the database's clock went back more than ``lookback`` since the
        previous claim (a failover to a lagging host): rows written since lie behind marks
        taken on the other clock (DESIGN invariant 25)."""
        stepped_back = self.db_now is not None and db_now < self.db_now - timedelta(seconds=self.lookback)
        if stepped_back and self.full_at != monotonic_now:
            self.forget(monotonic_now)
        self.db_now = db_now

    def readmit(
        self, excluded: frozenset[str], monotonic_now: float, *, keyed: frozenset[str] = frozenset()
    ) -> None:
        """Note the types this claim leaves out; a full pass when one of the last claim's is back.

        While an event type is left out of the general statements (paused, held by a
        RateLimited outcome), they step over its rows and their marks move past them; when it
        comes back (resumed, hold over, limit removed) its rows lie behind the marks, and only a
        scan from the beginning finds them at once (DESIGN invariant 23).
        """
        if self.excluded - excluded and self.full_at != monotonic_now:
            self.forget(monotonic_now)
        for event_type in self.keyed - keyed:
            # Its keyed rows come back to its own statements: from the start of their index.
            for scan in ("expired", "heads", "pending"):
                self.typed.pop((scan, event_type), None)
        self.excluded = excluded
        self.keyed = keyed

    def since(self, mark: datetime | None) -> datetime | None:
        """The lower bound of a scan whose previous claim stopped at ``mark`` (None: from the start)."""
        return None if mark is None else mark - timedelta(seconds=self.lookback)

    @staticmethod
    def moved(asked: int, rows: Sequence[Taken], now: datetime) -> datetime | None:
        """Where a scan's mark goes after a claim statement asked ``asked`` rows and got ``rows``.

        Fewer than asked: every row due at ``now`` was taken, the mark is ``now``. As many: the
        rest starts at the last row taken (its ``available_at``).
        """
        if len(rows) < asked or not rows:
            return now
        return max(r.available_at for r in rows)
