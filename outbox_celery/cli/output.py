"""How commands print: JSON for machines, plain text tables for people, and producer-supplied
text (event types, keys, errors) made safe for a terminal."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import click

__all__ = ["echo_json", "excerpt", "printable", "printable_lines", "text_table"]


def echo_json(data: Any) -> None:
    """Print ``data`` as indented JSON (times in ISO 8601, anything else unknown as its text)."""
    click.echo(json.dumps(data, indent=2, default=_json_default, ensure_ascii=False))


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def text_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> str:
    """A plain text table; columns whose index is in ``right`` are right-aligned."""
    cells = [[str(h) for h in headers]] + [["-" if v is None else printable(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [r[i].rjust(widths[i]) if i in right else r[i].ljust(widths[i]) for i in range(len(r))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def printable(text: Any) -> str:
    """``text`` safe to print on a terminal: producer-supplied text (event types, keys, errors)
    with a control or format character (an escape sequence, a bidi override) is shown as its
    escaped repr, quoted; plain printable text is shown as it is.
    """
    text = str(text)
    return text if text.isprintable() else repr(text)


def printable_lines(text: str) -> str:
    """Multi-line text (a traceback) with each line made safe by :func:`printable`."""
    return "\n".join(printable(line) for line in text.splitlines())


def excerpt(text: str | None, width: int = 60) -> str:
    """The first line of ``text``, made printable, cut to ``width`` characters (``-`` if none)."""
    if not text:
        return "-"
    line = text.strip().splitlines()[0] if text.strip() else ""
    line = printable(line)
    return line if len(line) <= width else line[: width - 3] + "..."
