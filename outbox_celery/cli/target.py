"""What a command acts on: a database, a table and, optionally, an Outbox (:class:`Target`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import click
import psycopg
from psycopg.conninfo import conninfo_to_dict

from ..config import OutboxConfig
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
    ) -> None:
        self._dsn = dsn
        self._table = table
        self._app_spec = app_spec
        self._finder = outbox_finder
        self._outbox: OperatedOutbox | None = None
        self._loaded = False

    def override(
        self, *, dsn: str | None = None, table: str | None = None, app_spec: str | None = None
    ) -> None:
        """Replace the DSN, the table or the Outbox's spec (options given after the command)."""
        if dsn is not None:
            self._dsn = dsn
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
    def dsn(self) -> str:
        """``--dsn``/``OUTBOX_DSN``, else the Outbox's; a one-line error when there is none."""
        dsn = self._dsn or (self.outbox.config.dsn if self.outbox is not None else None)
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
        """``table on <dsn without password>``, safe to print."""
        return f"table {self.table.qualified} on {redact(self.dsn)}"

    def scrub(self, text: str) -> str:
        """``text`` with the DSN's password (if any) masked."""
        dsn = self._dsn
        if not dsn and self._outbox is not None:
            dsn = self._outbox.config.dsn
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
