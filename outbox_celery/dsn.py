"""Connection strings made safe to print: the one place a DSN's password is looked up."""

from __future__ import annotations

import re
from urllib.parse import quote

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from .errors import first_line

__all__ = ["DSN_ENV", "error_line", "invalid_dsn", "password", "redact"]

# Where the DSN comes from when neither ``Outbox(dsn=...)`` nor ``outbox_dsn`` sets it (the CLI
# reads the same variable).
DSN_ENV = "OUTBOX_DSN"


def password(dsn: str) -> str | None:
    """The password ``dsn`` carries, if any; raises :class:`psycopg.ProgrammingError` if unparseable."""
    value = conninfo_to_dict(dsn).get("password")
    return str(value) if value else None


# libpq quotes the part of the DSN it stumbled on: "s3cr%t", "dbname", "=".
_QUOTED = re.compile(r'"([^"]*)"')
_URI = re.compile(r"^postgres(?:ql)?://", re.IGNORECASE)


def _shown(fragment: str) -> str:
    """A fragment libpq quoted: kept when it is punctuation (``"="``, ``"]"``), else hidden.

    Anything else is a piece of the DSN, which may be part of its password (``password=my
    secret`` makes libpq complain about ``"secret"``), even when it looks like a keyword.
    """
    if fragment and len(fragment) <= 2 and not any(c.isalnum() for c in fragment):
        return f'"{fragment}"'
    return "<hidden>"


def invalid_dsn(dsn: str, error: BaseException) -> str:
    """Why ``dsn`` could not be parsed, in one line that never shows the DSN or any part of it.

    ``error`` is the parser's (libpq's) error: the kind of mistake is kept, the pieces of the
    DSN it quotes are hidden, and a hint for the DSN's form (URI or ``key=value``) is added.
    """
    text = first_line(error)
    reason = _QUOTED.sub(lambda m: _shown(m.group(1)), text)
    if _URI.match(dsn.strip()):
        hint = (
            "URI form postgresql://user:password@host:port/dbname: percent-encode special "
            "characters (% as %25, @ as %40, / as %2F, a space as %20)"
        )
    else:
        hint = (
            "key=value form: pairs separated by spaces, a value with spaces or quotes in single "
            "quotes (password='a b')"
        )
    return f"invalid DSN: {reason} ({hint}; the DSN is not shown, it may hold a password)"


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
    password: ``invalid percent-encoded token: "p%zz..."``), so an unparseable ``dsn`` gives
    :func:`invalid_dsn`'s line instead (the kind of mistake, no piece of the DSN); otherwise
    any occurrence of the password (as written or percent-encoded) is replaced by ``***``.
    """
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    if dsn is None:
        return line
    try:
        secret = password(dsn)
    except psycopg.Error as unparseable:
        return invalid_dsn(dsn, unparseable)
    if secret:
        for form in {secret, quote(secret, safe=""), quote(secret)}:
            line = line.replace(form, "***")
    return line
