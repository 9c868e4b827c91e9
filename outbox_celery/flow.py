"""Flow control per event type: the limits a handler declares and what a claim may take.

Pure decisions, no I/O: :class:`Limit` (what ``@outbox.handler(..., concurrency=, rate=)``
declares), :func:`parse_rate` (Celery's rate strings) and :func:`allowance` (how many rows of a
limited event type one claim may hand out, from the state the claim read under the type's row
lock). The SQL that reads and writes that state is in ``sql/queries.sql`` (``flow_*``) and runs
in :func:`outbox_celery.claim.executor.claim`; docs/flow-control.md has the semantics (DESIGN
invariants 22 and 23).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .errors import ConfigurationError

__all__ = [
    "CAP_RECHECK",
    "LIMIT_RECHECK",
    "MAX_CONCURRENCY",
    "MAX_RATE",
    "MIN_RATE",
    "RATE_BURST",
    "Allowance",
    "Limit",
    "allowance",
    "parse_rate",
]

#: Seconds of a rate limit's starts one claim may take at once: the token bucket holds
#: ``max(1, rate x RATE_BURST)`` tokens. It is also the tolerance of the rate bound: any window
#: of ``T`` seconds sees at most ``rate x T + max(1, rate x RATE_BURST)`` starts.
RATE_BURST = 0.2

#: Seconds the push listener waits before claiming again while an event type is held at its
#: concurrency limit, when no freed slot's notification came first.
LIMIT_RECHECK = 0.05

#: Seconds the push listener waits before claiming again while an event type (or one of its limit
#: keys) sits at its concurrency limit and no freed slot's notification came: a finish notifies
#: (``slot_freed``), so this only catches slots freed without one (a lease that ran out). At most
#: one claim run per second per type held at its limit while nothing finishes.
CAP_RECHECK = 1.0

#: The largest ``concurrency`` and ``key_concurrency`` accepted: far above any real bound, and
#: inside PostgreSQL's ``int`` (the claim passes them as ``int``).
MAX_CONCURRENCY = 1_000_000

#: The largest ``rate`` and ``key_rate`` accepted, starts per second.
MAX_RATE = 1_000_000.0

#: The smallest ``rate`` and ``key_rate`` accepted, starts per second: one a day.
MIN_RATE = 1.0 / 86400.0

#: Seconds a delivery process trusts what it last read of which concurrency-limited types the
#: claim left at their limit (whose finishes wake the claim) before reading it again.
AT_CAP_TTL = 0.1

#: The allowance of a type that only limits its keys: the claim's batch is the bound.
UNBOUNDED = 1 << 30

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:/\s*([smh]))?\s*$")


def parse_rate(value: str | float | int) -> float:
    """Starts per second from Celery's rate forms: ``"50/s"``, ``"3000/m"``, ``"10/h"``, or a
    number (or a bare number in a string), meaning per second.

    :raises ConfigurationError: (a :class:`ValueError`) anything else, or a rate outside
        :data:`MIN_RATE` (one a day) to :data:`MAX_RATE` starts per second.
    """
    if isinstance(value, bool):
        raise ConfigurationError(f"rate must be a number or a string like '50/s', not {value!r}")
    if isinstance(value, int | float):
        per_second = float(value)
    elif isinstance(value, str) and (m := _RATE.match(value)):
        per_second = float(m.group(1)) / _UNITS[m.group(2) or "s"]
    else:
        raise ConfigurationError(
            f"malformed rate {value!r}: use a number of starts per second or '<n>/s', '<n>/m', "
            "'<n>/h' (Celery's rate forms), e.g. '50/s' or '3000/m'"
        )
    if not math.isfinite(per_second) or per_second <= 0:
        raise ConfigurationError(f"rate {value!r} must be more than zero starts per second")
    if not MIN_RATE <= per_second <= MAX_RATE:
        raise ConfigurationError(
            f"rate {value!r} must be from one a day to {MAX_RATE:,.0f} starts per second"
        )
    return per_second


@dataclass(frozen=True, slots=True)
class Limit:
    """The global limits of one event type, across every worker (DESIGN invariant 22).

    :ivar concurrency: live deliveries at most: rows ``processing`` under a live lease, claimed
        or running, counted over every worker; ``None``: no bound.
    :ivar rate: starts per second at most (claims handed out, re-claims of expired leases
        included); ``None``: no bound.
    :ivar key_concurrency: live deliveries at most per limit key (the ``limit_key`` given at
        enqueue), counted as ``concurrency`` is; rows of the type are claimed key by key, round
        robin, so that one busy key does not starve the others (DESIGN invariant 24). ``None``:
        no bound per key.
    :ivar key_rate: starts per second at most per limit key, a token bucket per key holding
        ``max(1, key_rate x RATE_BURST)`` starts (as ``rate`` for the type); ``None``: no bound.
    """

    concurrency: int | None = None
    rate: float | None = None
    key_concurrency: int | None = None
    key_rate: float | None = None

    def __post_init__(self) -> None:
        # Every bound checked where a Limit is made, so that no claim ever carries one out of
        # range into SQL (one bad limit would fail the claim of every type).
        for name in ("concurrency", "key_concurrency"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CONCURRENCY
            ):
                raise ConfigurationError(
                    f"{name} must be an integer from 1 to {MAX_CONCURRENCY:,}, not {value!r}"
                )
        for name in ("rate", "key_rate"):
            value = getattr(self, name)
            if value is not None:
                parse_rate(value)

    @classmethod
    def declared(
        cls,
        *,
        concurrency: int | None,
        rate: str | float | int | None,
        key_concurrency: int | None = None,
        key_rate: str | float | int | None = None,
    ) -> Limit | None:
        """The limit ``@outbox.handler(concurrency=..., rate=..., key_concurrency=...,
        key_rate=...)`` declares (``None``: none).

        :raises ConfigurationError: ``concurrency`` or ``key_concurrency`` not an integer from 1
            to :data:`MAX_CONCURRENCY`, or a bad ``rate`` or ``key_rate`` (:func:`parse_rate`).
        """
        per_second = None if rate is None else parse_rate(rate)
        per_key = None if key_rate is None else parse_rate(key_rate)
        if concurrency is None and per_second is None and key_concurrency is None and per_key is None:
            return None
        return cls(
            concurrency=concurrency, rate=per_second, key_concurrency=key_concurrency, key_rate=per_key
        )

    @property
    def keyed(self) -> bool:
        """Whether rows of the type are claimed per limit key (a limit per key is declared)."""
        return self.key_concurrency is not None or self.key_rate is not None

    @property
    def key_burst(self) -> float:
        """Tokens a full bucket of one key holds (``max(1, key_rate x RATE_BURST)``); 0 without."""
        return 0.0 if self.key_rate is None else max(1.0, self.key_rate * RATE_BURST)

    @property
    def burst(self) -> float:
        """Tokens a full bucket holds (``max(1, rate x RATE_BURST)``); 0 without a rate."""
        return 0.0 if self.rate is None else max(1.0, self.rate * RATE_BURST)


@dataclass(frozen=True, slots=True)
class Allowance:
    """What one claim may take of a limited event type, and the bucket it leaves behind.

    :ivar rows: rows this claim may hand out (0 or more).
    :ivar tokens: the bucket after refilling, before this claim takes anything (``None``: no
        rate limit).
    :ivar by_rate: whether the rate, rather than concurrency, decided ``rows``.
    """

    rows: int
    tokens: float | None
    by_rate: bool

    def at_cap(self, limit: Limit, taken: int) -> bool:
        """Whether this claim left the type at its concurrency limit: it took all it was allowed
        and concurrency, not the rate, decided how much that was (a freed slot then wakes the
        claim, docs/flow-control.md)."""
        return limit.concurrency is not None and not self.by_rate and taken >= self.rows

    def wait(self, limit: Limit, taken: int) -> float | None:
        """Seconds until claiming again can take more, when this claim was held by the limit.

        ``None`` when the limit did not hold it (it took fewer rows than it was allowed: nothing
        more of the type was claimable).
        """
        if taken < self.rows:
            return None
        if self.by_rate and limit.rate is not None and self.tokens is not None:
            left = self.tokens - taken
            return max(LIMIT_RECHECK, (1.0 - left) / limit.rate)
        # At its concurrency limit: a finish wakes the claim (at_cap); this only catches a slot
        # freed without one.
        return CAP_RECHECK


def allowance(limit: Limit, *, live: int, tokens: float | None, since_refill: float | None) -> Allowance:
    """How many rows of a limited event type one claim may hand out now.

    :param live: its live deliveries, counted after its row lock (rows ``processing`` whose
        lease has not run out).
    :param tokens: its bucket as last written (``None``: never written, a full bucket).
    :param since_refill: seconds (database clock) since the bucket was last written.
    """
    rows = math.inf
    by_rate = False
    if limit.concurrency is not None:
        rows = max(0, limit.concurrency - live)
    now_tokens: float | None = None
    if limit.rate is not None:
        burst = limit.burst
        elapsed = max(0.0, since_refill or 0.0)
        now_tokens = burst if tokens is None else min(burst, max(0.0, tokens) + limit.rate * elapsed)
        by_rate = math.floor(now_tokens) < rows
        rows = min(rows, math.floor(now_tokens))
    # No bound of the type itself (a limit per key only): the claim's batch bounds it.
    return Allowance(rows=int(min(rows, UNBOUNDED)), tokens=now_tokens, by_rate=by_rate)
