"""Durations as operators type and read them (``7d``, ``12h``, ``1h30m`` in, ``3d 4h`` out), and
the bound past which a claimable message is overdue."""

from __future__ import annotations

import math
import re

__all__ = ["CLAIM_OVERDUE_MARGIN", "format_duration", "overdue_after", "parse_duration"]

_UNITS = {"w": 7 * 86400.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
_DURATION = re.compile(r"(?:\d+(?:\.\d+)?[wdhms])+")
_PART = re.compile(r"(\d+(?:\.\d+)?)([wdhms])")


def parse_duration(text: str) -> float:
    """Seconds in ``text``: a number and a unit, or several (``7d``, ``12h``, ``1h30m``, ``1w``).

    Units: ``w`` weeks, ``d`` days, ``h`` hours, ``m`` minutes, ``s`` seconds. A bare number is
    refused (is ``7`` seconds or days?). Raises :class:`ValueError` with a one-line message.
    """
    value = text.strip().lower() if isinstance(text, str) else ""
    if not _DURATION.fullmatch(value):
        raise ValueError(
            f"malformed duration {text!r}: use a number and a unit (w, d, h, m, s), "
            "e.g. 7d, 12h, 30m, 45s, 1w"
        )
    seconds = sum(float(n) * _UNITS[unit] for n, unit in _PART.findall(value))
    if not math.isfinite(seconds):
        raise ValueError(f"duration {text!r} is too large")
    return seconds


def format_duration(seconds: float | None) -> str:
    """A short human form of ``seconds``: ``45s``, ``12m 5s``, ``5h``, ``3d 4h``; ``-`` for None."""
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    for size, unit, sub_size, sub_unit in ((86400, "d", 3600, "h"), (3600, "h", 60, "m"), (60, "m", 1, "s")):
        if s >= size:
            rest = s % size // sub_size
            return f"{s // size}{unit} {rest}{sub_unit}" if rest else f"{s // size}{unit}"
    return f"{s}s"


#: A running outbox claims a due message at its next claim run, one claim interval at most (at
#: once with push). A claimable message left one interval plus this margin (a claim run's own
#: budget, beat sending late) is overdue: no claim ran for it.
CLAIM_OVERDUE_MARGIN = 5.0


def overdue_after(claim_interval: float) -> float:
    """Seconds a claimable message may wait before it is reported unclaimed: one
    ``claim_interval`` plus :data:`CLAIM_OVERDUE_MARGIN` (``stats``' attention line, the
    console's flags)."""
    return claim_interval + CLAIM_OVERDUE_MARGIN
