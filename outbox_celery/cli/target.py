"""What a command acts on: a database, a table and, optionally, an Outbox (:class:`Target`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import click
import psycopg
from psycopg.conninfo import conninfo_to_dict

from ..config import OutboxConfig
from ..databases import Database
from ..dsn import invalid_dsn, password, redact
from ..errors import first_line
from ..operated import OperatedOutbox
from ..table import TableName
from .discovery import resolve_outbox

__all__ = ["DEFAULT_CLAIM_INTERVAL", "Target"]

#: The claim interval of an outbox when no Outbox is loaded (``-A``): the default one.
DEFAULT_CLAIM_INTERVAL = OutboxConfig().claim_interval


class Target:
    """What a command acts on: a database, a table and, optionally, an Outbox (its handlers)."""

    def __init__(
        self,
        *,
        dsn: str | None,
        table: str | None,
        app_spec: str | None = None,
        outbox_finder: Callable[[], OperatedOutbox | None] | None = None,
        database: str | None = None,
        dsn_from_env: bool = False,
    ) -> None:
        self._dsn = dsn
        # OUTBOX_DSN rather than --dsn: it names no database of an Outbox that serves several.
        self._dsn_from_env = dsn_from_env and dsn is not None
        self._table = table
        self._database = database
        self._app_spec = app_spec
        self._finder = outbox_finder
        self._outbox: OperatedOutbox | None = None
        self._loaded = False

    def override(
        self,
        *,
        dsn: str | None = None,
        table: str | None = None,
        app_spec: str | None = None,
        database: str | None = None,
    ) -> None:
        """Replace the DSN, the table, the Outbox's spec or the database (options given after
        the command)."""
        if database is not None:
            self._database = database
        if dsn is not None:
            self._dsn, self._dsn_from_env = dsn, False
        if table is not None:
            self._table = table
        if app_spec is not None:
            self._app_spec = app_spec
            self._outbox, self._loaded = None, False

    @property
    def outbox(self) -> OperatedOutbox | None:
        """The loaded Outbox (``-A``), or ``None``."""
        if not self._loaded:
            self._loaded = True
            if self._app_spec:
                self._outbox = resolve_outbox(self._app_spec)
            elif self._finder is not None:
                self._outbox = self._finder()
        return self._outbox

    @property
    def _given(self) -> str | None:
        """``--dsn``, or ``OUTBOX_DSN`` unless the loaded Outbox serves several databases (an
        environment set for one database does not silently replace ``--database``)."""
        if self._dsn_from_env and self.outbox is not None and self.outbox.databases:
            return None
        return self._dsn

    @property
    def database_names(self) -> list[str]:
        """The databases of the loaded Outbox when it serves several and no ``--dsn`` is given
        (what ``migrate`` goes through); otherwise empty."""
        if self._given or self.outbox is None:
            return []
        return sorted(self.outbox.databases)

    @property
    def database(self) -> str | None:
        """``--database``/``OUTBOX_DATABASE``: which database of the Outbox, when it serves several."""
        return self._database

    def _declared(self) -> Database | None:
        """The loaded Outbox's database named by ``--database`` (``None``: one ``dsn``).

        A one-line error when the Outbox serves several and none (or an unknown one) is named.
        """
        outbox = self.outbox
        declared = outbox.databases if outbox is not None else {}
        if not declared:
            if self._database is not None and not self._given:
                raise click.ClickException(
                    f"--database {self._database}: the outbox serves one database (its dsn), not several"
                )
            return None
        if self._database is None:
            raise click.ClickException(
                f"the outbox serves several databases ({', '.join(sorted(declared))}): pass --database NAME"
            )
        db = declared.get(self._database)
        if db is None:
            raise click.ClickException(
                f"the outbox serves no database {self._database!r} (it serves: {', '.join(sorted(declared))})"
            )
        return db

    @property
    def dsn(self) -> str:
        """``--dsn``/``OUTBOX_DSN``, else the Outbox's (its ``--database``'s); a one-line error
        when there is none. ``OUTBOX_DSN`` is not read for an Outbox that serves several."""
        dsn = self._given
        if not dsn and self.outbox is not None:
            db = self._declared()
            dsn = db.dsn if db is not None else self.outbox.config.dsn
        if not dsn:
            raise click.ClickException(
                "no database: pass --dsn or set OUTBOX_DSN (or -A module:outbox with a dsn)"
            )
        return dsn

    @property
    def table(self) -> TableName:
        """``--table``/``OUTBOX_TABLE``, else the Outbox's, else ``outbox``."""
        if self._table:
            return TableName.parse(self._table)
        if self.outbox is not None:
            db = None if self._given else self._declared()
            if db is not None and db.table:
                return TableName.parse(db.table)
            return self.outbox.config.table
        return TableName("outbox")

    @property
    def claim_interval(self) -> float:
        """The loaded Outbox's ``claim_interval``, else :data:`DEFAULT_CLAIM_INTERVAL`."""
        return self.outbox.config.claim_interval if self.outbox is not None else DEFAULT_CLAIM_INTERVAL

    @property
    def handlers(self) -> set[str] | None:
        """Event types with a handler, when an Outbox is loaded."""
        return set(self.outbox.handlers) if self.outbox is not None else None

    @property
    def where(self) -> str:
        """``table on <dsn without password>``, safe to print (after ``database <name>:``
        when the Outbox serves several)."""
        named = f"database {self._database}: " if self._database and not self._given else ""
        return f"{named}table {self.table.qualified} on {redact(self.dsn)}"

    def scrub(self, text: str) -> str:
        """``text`` with the DSN's password (if any) masked."""
        dsns = [self._dsn]
        if self._outbox is not None:
            dsns += [self._outbox.config.dsn, *(db.dsn for db in self._outbox.databases.values())]
        for dsn in dsns:
            try:
                secret = password(dsn) if dsn else None
            except psycopg.Error:
                secret = None
            if secret:
                text = text.replace(secret, "***")
        return text

    @contextlib.contextmanager
    def connect(self) -> Iterator[psycopg.Connection[Any]]:
        """An autocommit connection (10 s connect timeout unless the DSN sets one)."""
        dsn = self.dsn
        try:
            params = conninfo_to_dict(dsn)
        except psycopg.Error as exc:
            # The parser's message may quote the DSN, password included: only its kind is shown.
            raise click.ClickException(invalid_dsn(dsn, exc)) from None
        extra: dict[str, Any] = {"autocommit": True}
        if "connect_timeout" not in params:
            extra["connect_timeout"] = 10
        if "application_name" not in params:
            extra["application_name"] = "outbox-celery-cli"
        try:
            conn = psycopg.connect(dsn, **extra)
        except psycopg.Error as exc:
            raise click.ClickException(
                self.scrub(f"cannot connect to {redact(dsn)}: {first_line(exc)}")
            ) from None
        with conn:
            yield conn
