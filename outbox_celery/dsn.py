"""Connection strings made safe to print: the one place a DSN's password is looked up."""

from __future__ import annotations

from urllib.parse import quote

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

__all__ = ["DSN_ENV", "error_line", "password", "redact"]

# Where the DSN comes from when neither ``Outbox(dsn=...)`` nor ``outbox_dsn`` sets it (the CLI
# reads the same variable).
DSN_ENV = "OUTBOX_DSN"


def password(dsn: str) -> str | None:
    """The password ``dsn`` carries, if any; raises :class:`psycopg.ProgrammingError` if unparseable."""
    value = conninfo_to_dict(dsn).get("password")
    return str(value) if value else None


def redact(dsn: str) -> str:
    """``dsn`` with any password replaced, safe to print."""
    try:
        parts = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "<unparseable dsn>"
    if parts.get("password"):
        parts["password"] = "***"
    return make_conninfo("", **parts)


def error_line(exc: BaseException, dsn: str | None) -> str:
    """The first line of ``exc``'s message, safe to log for a connection made with ``dsn``.

    libpq quotes the offending part of a DSN it cannot parse (an unencoded ``%`` in a
    password: ``invalid percent-encoded token: "p%zz..."``), so an unparseable ``dsn`` gives a
    fixed line instead; otherwise any occurrence of the password (as written or
    percent-encoded) is replaced by ``***`` (#21).
    """
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    if dsn is None:
        return line
    try:
        secret = password(dsn)
    except psycopg.Error:
        return "invalid DSN: it could not be parsed (not shown)"
    if secret:
        for form in {secret, quote(secret, safe=""), quote(secret)}:
            line = line.replace(form, "***")
    return line
