"""Pure retry backoff policy (no I/O, no clock)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Backoff", "RetryPolicy"]

#: Seconds to wait before the next attempt, from the attempt just made (1-based) and the
#: :class:`~outbox_celery.errors.RetryableError` it raised. Called only when the error carries
#: no ``delay`` of its own; ``max_attempts`` still ends the retries. :class:`Backoff` is one.
RetryPolicy = Callable[[int, BaseException], float]


@dataclass(frozen=True, slots=True)
class Backoff:
    """Full-jitter exponential backoff.

    The delay after attempt ``n`` (1-based) is drawn uniformly from
    ``[0, min(cap, base * 2 ** n)]`` (AWS "full jitter"). Spreading retries over the whole window
    keeps a downstream that just recovered from being hit by every message at once.

    :param base: seconds; the window after the first attempt is ``2 * base``.
    :param cap: seconds; the window never grows past this.
    """

    base: float = 1.0
    cap: float = 300.0

    def __post_init__(self) -> None:
        if not self.base > 0:
            raise ValueError(f"backoff base must be > 0, got {self.base!r}")
        if not self.cap >= self.base:
            raise ValueError(f"backoff cap must be >= base, got cap={self.cap!r} base={self.base!r}")

    def window(self, attempt: int) -> float:
        """Upper bound of the delay after ``attempt`` (the jitter window)."""
        if attempt < 0:
            raise ValueError(f"attempt must be >= 0, got {attempt}")
        # 2 ** attempt overflows float quickly; stop doubling once past the cap.
        if attempt >= 64:
            return self.cap
        return min(self.cap, self.base * float(2**attempt))

    def __call__(self, attempt: int, error: BaseException) -> float:
        """The :data:`RetryPolicy` form: :meth:`delay` for ``attempt``, whatever the error."""
        return self.delay(attempt)

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """A random delay in ``[0, window(attempt)]``."""
        return float((rng or random).uniform(0.0, self.window(attempt)))
