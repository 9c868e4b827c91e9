"""Several databases served by one Outbox: :class:`Database` and how ``databases=`` is read.

``Outbox(app, databases={"eu": DSN_EU, "us": DSN_US})`` declares each database by name; the
value is a DSN or a :class:`Database` (a DSN with its own table, for a schema per tenant, or its
own LISTEN DSN). ``databases=`` may also be a list of :class:`Database`, or a callable that
returns either form: the Outbox calls it again every ``databases_refresh`` seconds, so a tenant
added at run time is served without a restart (docs/databases.md, DESIGN invariant 34).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import psycopg
from psycopg.conninfo import conninfo_to_dict

from .errors import ConfigurationError

__all__ = ["Database", "DatabasesSetting", "database_map", "valid_database_name"]

# A name travels in task arguments, task ids, Flower's task names, metric labels and command
# lines: letters, digits and ``_.-``, starting with a letter or digit.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")


def valid_database_name(name: object) -> str:
    """``name`` when it is a valid database name, else :class:`ConfigurationError`."""
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise ConfigurationError(
            f"invalid database name {name!r}: use 1-63 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    return name


@dataclass(frozen=True, slots=True)
class Database:
    """One database of an Outbox that serves several.

    :ivar name: how tasks, handlers (:attr:`Message.database
        <outbox_celery.message.Message.database>`), commands (``--database``) and metrics
        (``database=``) name it.
    :ivar dsn: its connection string (left out of ``repr``).
    :ivar table: its outbox table, ``"name"`` or ``"schema.name"`` (a schema per tenant);
        ``None``: the Outbox's ``table``. Checked with the Outbox's settings.
    :ivar listen_dsn: the DSN of its push listener's session, when ``dsn`` points at a pooler in
        transaction mode; ``None``: ``dsn``.
    """

    name: str
    dsn: str = field(repr=False)
    table: str | None = None
    listen_dsn: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        valid_database_name(self.name)
        if self.table is not None and not isinstance(self.table, str):
            raise ConfigurationError(f"database {self.name}: table must be a string")
        for what in ("dsn", "listen_dsn"):
            value = getattr(self, what)
            if value is None and what == "listen_dsn":
                continue
            if not isinstance(value, str) or not value:
                raise ConfigurationError(f"database {self.name}: {what} must be a non-empty string")
            try:
                conninfo_to_dict(value)
            except psycopg.Error:
                # libpq's message may quote the DSN, password included: only where it failed.
                raise ConfigurationError(f"database {self.name}: its {what} does not parse") from None


#: What ``databases=`` takes: name -> DSN or :class:`Database`, a list of :class:`Database`, or a
#: callable returning either (called again every ``databases_refresh`` seconds).
_Declared: TypeAlias = "Mapping[str, str | Database] | Iterable[Database]"
DatabasesSetting: TypeAlias = "_Declared | Callable[[], _Declared]"


def database_map(value: Any) -> dict[str, Database]:
    """The databases ``value`` declares, by name (a callable is called once).

    :raises ConfigurationError: a bad name, DSN or table, a name given twice, or a value of
        another kind; the message never quotes a DSN.
    """
    if callable(value) and not isinstance(value, Mapping):
        value = value()
    found: dict[str, Database] = {}
    if isinstance(value, Mapping):
        for name, spec in value.items():
            if isinstance(spec, Database):
                if spec.name != name:
                    raise ConfigurationError(
                        f"database {name!r} is declared as a Database named {spec.name!r}"
                    )
                db = spec
            elif isinstance(spec, str):
                db = Database(valid_database_name(name), spec)
            else:
                raise ConfigurationError(
                    f"database {name!r}: give a DSN string or a Database, got {type(spec).__name__}"
                )
            found[db.name] = db
        return found
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ConfigurationError(
            "databases must map names to DSNs, list Database values, or be a callable returning "
            f"either; got {type(value).__name__}"
        )
    for db in value:
        if not isinstance(db, Database):
            raise ConfigurationError(f"a list of databases holds Database values, got {type(db).__name__}")
        if db.name in found:
            raise ConfigurationError(f"database {db.name!r} is declared twice")
        found[db.name] = db
    return found
