"""One line of an exception's message, for one-line reports and logs."""

from __future__ import annotations

__all__ = ["first_line"]


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type's name if empty), for one-line reports."""
    text = str(exc).strip()
    return text.splitlines()[0].strip() if text else type(exc).__name__
