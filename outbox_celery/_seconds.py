"""One validator for every duration the library takes in seconds: settings, delays, retention."""

from __future__ import annotations

import math
from datetime import timedelta

__all__ = ["MAX_DELAY_SECONDS", "seconds"]

# make_interval() overflows silently on PostgreSQL 15 for absurd values; nothing real waits this long.
MAX_DELAY_SECONDS = 100 * 365 * 86400.0


def seconds(
    value: object,
    name: str,
    *,
    error: type[Exception] = ValueError,
    positive: bool = False,
    delay: bool = False,
) -> float:
    """``value`` (a number or a :class:`~datetime.timedelta`) as float seconds, or raise ``error``.

    Refuses booleans (``True`` is not one second), NaN, infinity and negatives; zero too when
    ``positive``; more than :data:`MAX_DELAY_SECONDS` for a ``delay`` (a row's due time).
    """
    if delay:
        wanted = "a number of seconds between 0 and 100 years"
    else:
        wanted = f"a {'positive' if positive else 'non-negative'} number of seconds"
    if isinstance(value, timedelta):
        result = value.total_seconds()
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise error(f"{name} must be {wanted} (a number or a timedelta), got {value!r}")
    else:
        result = float(value)
    too_large = delay and result > MAX_DELAY_SECONDS
    if not math.isfinite(result) or result < 0 or (positive and result == 0) or too_large:
        raise error(f"{name} must be {wanted}, got {value!r}")
    return result
