"""Connection strings made safe to print: the one place a DSN's password is looked up."""

from __future__ import annotations

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

__all__ = ["DSN_ENV", "password", "redact"]

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
