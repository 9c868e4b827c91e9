"""HTML fragments of the admin's columns and detail page (escaped by ``format_html``)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from django.utils import timezone
from django.utils.html import format_html, format_html_join

from ... import ops

__all__ = ["attempts_table", "preformatted", "when"]


def when(value: datetime | None) -> str:
    """A time on two short lines (date, then time) in the current time zone; the full form on hover."""
    if value is None:
        return "-"
    local = timezone.localtime(value) if timezone.is_aware(value) else value
    return format_html(
        '<span title="{}" style="white-space:nowrap">{}<br>{}</span>',
        local.isoformat(sep=" ", timespec="seconds"),
        local.strftime("%Y-%m-%d"),
        local.strftime("%H:%M:%S"),
    )


def preformatted(text: str) -> str:
    """``text`` as a block that keeps its lines and wraps (a payload, an error)."""
    return format_html('<pre style="margin:0;white-space:pre-wrap">{}</pre>', text)


def attempts_table(errors: Sequence[Any] | None) -> str:
    """A message's ``errors`` column (DESIGN invariant 32) as a table, the latest attempt first;
    ``-`` while it never failed."""
    entries = ops.failed_attempts(errors)
    if not entries:
        return "-"
    rows = format_html_join(
        "",
        "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
        ((e.attempt, when(e.at), preformatted(e.error)) for e in entries),
    )
    return format_html("<table><tr><th>attempt</th><th>at</th><th>error</th></tr>{}</table>", rows)
