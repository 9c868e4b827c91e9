"""How the console shows what a row holds: its payload as the handler receives it, its error
history as the row keeps it, and the hour's chart as SVG geometry.

Pure functions of what :mod:`outbox_celery.ops` read; the templates escape everything they put
on a page (payloads and errors are untrusted text).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from .. import codec
from ..ops.durations import format_duration

if TYPE_CHECKING:
    from ..ops import console

__all__ = ["Payload", "chart", "error_heading", "error_history", "payload", "short_payload"]

#: Characters of a payload the dead-letter list shows.
SHORT_PAYLOAD = 200

# The notes the statements put before the error they replace (requeue and skip in admin.sql,
# the reaper's and the start's "attempts exhausted" and the unroutable note in queries.sql):
# each keeps the error before it behind one of these two separators.
_EARLIER = re.compile(r"; (?:previous|last) error: ")


@dataclass(frozen=True, slots=True)
class Payload:
    """A payload as the page shows it: ``text``, and why it is shown as stored (``note``),
    when this process cannot decode it."""

    text: str
    note: str | None = None


def payload(stored: Any) -> Payload:
    """``stored`` (the ``json`` column as psycopg loads it) as its handler receives it: kombu's
    envelopes (``{"__type__": "uuid", ...}``) decoded by :func:`outbox_celery.codec.decode`, and
    the values they carry written as what they are (``UUID 1b4e...``, ``Decimal 12.50``)."""
    try:
        value = codec.decode(stored)
    except codec.PayloadError as exc:
        as_stored = json.dumps(stored, indent=2, ensure_ascii=False, sort_keys=True)
        return Payload(as_stored, f"shown as stored: {exc}")
    return Payload(_readable(value, "\n", 0))


def short_payload(row: console.DeadRow) -> str:
    """A dead-letter list's payload cell: the decoded payload on one line when the row read it
    whole (:attr:`~outbox_celery.ops.console.DeadRow.payload_json`), else its stored text, cut
    to :data:`SHORT_PAYLOAD` characters."""
    text = row.payload or ""
    if row.payload_json is not None:
        # An envelope this process cannot decode: the stored text, as the message page says.
        with contextlib.suppress(codec.PayloadError):
            text = _readable(codec.decode(row.payload_json), "", 0)
    return text if len(text) <= SHORT_PAYLOAD else text[: SHORT_PAYLOAD - 1] + "\u2026"


def _readable(value: Any, newline: str, depth: int) -> str:
    """JSON's layout, with every value kombu carries beside JSON's own written as
    ``<type> <value>``. ``newline`` empty: one line."""
    inner = newline + "  " * (depth + 1) if newline else ""
    close = newline + "  " * depth if newline else ""
    sep = "," + inner if newline else ", "
    if isinstance(value, dict):
        if not value:
            return "{}"
        items = (f"{_json(str(k))}: {_readable(v, newline, depth + 1)}" for k, v in value.items())
        return "{" + inner + sep.join(items) + close + "}"
    if isinstance(value, list):
        if not value:
            return "[]"
        return "[" + inner + sep.join(_readable(v, newline, depth + 1) for v in value) + close + "]"
    if value is None or isinstance(value, (str, int, float, bool)):
        return _json(value)
    if isinstance(value, bytes):
        return f"bytes {value!r}"
    return f"{type(value).__name__} {value}"


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def error_history(last_error: str | None) -> list[str]:
    """``last_error`` split into what it keeps, the latest first: an operator's requeue or skip
    and the "attempts exhausted" and unroutable notes keep the error before them behind
    ``; previous error:`` or ``; last error:``. A retry's new error replaces the previous one,
    so earlier attempts' errors are not in it."""
    if not last_error:
        return []
    return _EARLIER.split(last_error)


def error_heading(status: str, attempts: int, last_error: str | None, *, skipped: bool) -> tuple[str, str]:
    """The heading of a message's error and what it says about the message now.

    The error is the current one only while the message is dead or waits for a retry; once it
    was delivered, skipped, requeued or runs again, it is an earlier attempt's.
    """
    if not last_error:
        return "Last error", "none recorded"
    if skipped:
        return "Error of an earlier attempt", "skipped by an operator since: the message will not run"
    if status == "done":
        return "Error of an earlier attempt", "delivered since: this error is history"
    if status == "processing":
        return "Error of an earlier attempt", "a new attempt is under way"
    if status == "pending" and attempts == 0:
        return "Error of an earlier attempt", "requeued since: it has not failed again"
    if status == "pending":
        return "Last error", "why it waits for another attempt"
    return "Last error", "why it is dead"


@dataclass(frozen=True, slots=True)
class _Tick:
    """An axis label at ``at`` (pixels along its axis)."""

    at: float
    label: str


# The chart's frame: the plot area inside margins for the axes' labels.
_WIDTH, _HEIGHT = 640, 170
_LEFT, _RIGHT, _TOP, _BOTTOM = 48, 64, 10, 40


def chart(minutes: Sequence[console.Minute]) -> dict[str, Any]:
    """The hour as SVG geometry: bars of done per minute (left axis), lines of the p50 and p99
    enqueue -> done latency (right axis), minute labels along the bottom, and the axes' titles."""
    plot_w, plot_h = _WIDTH - _LEFT - _RIGHT, _HEIGHT - _TOP - _BOTTOM
    step = plot_w / max(1, len(minutes))
    top = max([m.done for m in minutes] + [1])
    slowest = max([m.p99 or 0.0 for m in minutes] + [0.001])
    bottom = _TOP + plot_h

    def y(fraction: float) -> float:
        return round(bottom - plot_h * fraction, 1)

    bars = []
    p50, p99 = [], []
    for i, m in enumerate(minutes):
        x = _LEFT + i * step
        bars.append({"x": round(x, 1), "y": y(m.done / top), "h": round(plot_h * m.done / top, 1), "m": m})
        mid = round(x + step / 2, 1)
        if m.p50 is not None:
            p50.append(f"{mid},{y(m.p50 / slowest)}")
        if m.p99 is not None:
            p99.append(f"{mid},{y(m.p99 / slowest)}")
    halves = (0.0, 0.5, 1.0)
    return {
        "width": _WIDTH,
        "height": _HEIGHT,
        "left": _LEFT,
        "right": _LEFT + plot_w,
        "top_y": _TOP,
        "bottom": bottom,
        "step": round(step - 1, 1),
        "bars": bars,
        "p50": " ".join(p50),
        "p99": " ".join(p99),
        "done_ticks": [_Tick(y(f), f"{top * f:,.{0 if (top * f).is_integer() else 1}f}") for f in halves],
        "latency_ticks": [_Tick(y(f), _latency(slowest * f)) for f in halves],
        "minute_ticks": [
            _Tick(round(_LEFT + i * step + step / 2, 1), _clock(minutes[i].minute))
            for i in range(0, len(minutes), 15)
        ]
        + ([_Tick(round(_LEFT + (len(minutes) - 0.5) * step, 1), "now")] if minutes else []),
        "top": top,
        "slowest": slowest,
        "done": sum(m.done for m in minutes),
        "capped": any(m.capped for m in minutes),
    }


def _latency(seconds: float) -> str:
    if seconds == 0:
        return "0"
    return f"{seconds * 1000:,.0f} ms" if seconds < 10 else format_duration(seconds)


def _clock(minute: datetime) -> str:
    return minute.strftime("%H:%M")
