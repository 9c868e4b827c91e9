"""Versioned, idempotent schema management shipped inside the package.

``migrate(conn, table)`` brings one outbox table to the current version:

* a fresh database gets ``sql/schema.sql`` (the current schema in one piece) and every version
  recorded;
* an existing table gets the missing files of ``sql/migrations/`` applied in order;
* applying twice changes nothing.

Versions are recorded per table in ``outbox_celery_migrations``, created in the outbox table's
schema. Concurrent migrators serialize on an advisory lock.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any, NamedTuple

import psycopg
from psycopg import sql

from ..errors import MigrationError as MigrationError
from ..table import TableName
from . import rows as _rows
from . import statements as _sql

__all__ = [
    "OUTBOX",
    "Migration",
    "MigrationError",
    "MigrationSet",
    "applied_versions",
    "available",
    "migrate",
    "pending",
]

_FILE = re.compile(r"^(\d{4})_(\w+)\.sql$")
_LEDGER = "outbox_celery_migrations"


@dataclass(frozen=True, slots=True)
class Migration:
    """One numbered file of ``sql/migrations``."""

    version: int
    name: str
    filename: str
    folder: str = "migrations"

    @property
    def text(self) -> str:
        return _sql.read(f"{self.folder}/{self.filename}")


@dataclass(frozen=True, slots=True)
class MigrationSet:
    """One kind of table the runner manages: its migrations, fresh schema and ledger.

    The outbox table is :data:`OUTBOX`; the receiving side's inbox
    (:mod:`outbox_celery.inbox`) has its own set and ledger.
    """

    folder: str
    schema: str
    ledger: str
    compose: Callable[[str, TableName], sql.Composed]


OUTBOX = MigrationSet("migrations", "schema.sql", _LEDGER, _sql.compose)


def available(migrations: MigrationSet = OUTBOX) -> list[Migration]:
    """Every migration shipped with the package, in order."""
    folder = resources.files("outbox_celery.db").joinpath("sql", *migrations.folder.split("/"))
    found = []
    for entry in folder.iterdir():
        m = _FILE.match(entry.name)
        if m:
            found.append(Migration(int(m.group(1)), m.group(2), entry.name, migrations.folder))
    return sorted(found, key=lambda m: m.version)


def _ledger(table: TableName, name: str = _LEDGER) -> sql.Identifier:
    return sql.Identifier(table.schema, name) if table.schema else sql.Identifier(name)


class _Exists(NamedTuple):
    exists: bool


class _Name(NamedTuple):
    table_name: str


class _Version(NamedTuple):
    version: int


def _exists(conn: psycopg.Connection[Any], relation: sql.Identifier) -> bool:
    """Whether the table ``relation`` names exists."""
    query = "SELECT to_regclass(%s) IS NOT NULL AS exists"
    [row] = _rows.read(conn, _Exists, query, [relation.as_string(conn)])
    return bool(row.exists)


# The tables an outbox table owns beside it, named after it (DESIGN invariant 25).
_SIBLINGS = {
    _sql.INSTANCE_SUFFIX: "identity",
    _sql.FLOW_SUFFIX: "flow-control",
    _sql.FLOW_KEY_SUFFIX: "per-key flow-control",
    _sql.SUBSCRIPTION_SUFFIX: "subscriptions",
}


def _refuse_name_clash(conn: psycopg.Connection[Any], t: TableName) -> None:
    """Refuse a new outbox table whose name is one another outbox's tables beside it take (an
    outbox ``x_flow`` beside an outbox ``x``, whose flow table is ``x_flow``), or whose own
    tables would take another outbox's name: either would share a table between two roles."""
    ledger = _ledger(t)
    if not _exists(conn, ledger):
        return
    names = [t.name + suffix for suffix in _SIBLINGS]
    names += [t.name[: -len(suffix)] for suffix in _SIBLINGS if t.name.endswith(suffix)]
    query = sql.SQL("SELECT DISTINCT table_name FROM {} WHERE table_name = ANY(%s)").format(ledger)
    recorded = {r.table_name for r in _rows.read(conn, _Name, query, [names])}
    for suffix, role in _SIBLINGS.items():
        if t.name + suffix in recorded:
            raise MigrationError(
                f"cannot create outbox table {t.qualified}: its {role} table {t.name + suffix!r} "
                "would be the outbox table of that name; give one of them another name (table=)"
            )
        base = t.name[: -len(suffix)]
        if t.name.endswith(suffix) and base in recorded:
            raise MigrationError(
                f"cannot create outbox table {t.qualified}: {t.name!r} is the {role} table of the "
                f"outbox table {base!r}; give one of them another name (table=)"
            )


def applied_versions(
    conn: psycopg.Connection[Any], table: str | TableName = "outbox", *, migrations: MigrationSet = OUTBOX
) -> list[int]:
    """Versions recorded for ``table`` (empty when never migrated)."""
    t = TableName.parse(table)
    ledger = _ledger(t, migrations.ledger)
    if not _exists(conn, ledger):
        return []
    query = sql.SQL("SELECT version FROM {} WHERE table_name = %s ORDER BY version").format(ledger)
    return [int(r.version) for r in _rows.read(conn, _Version, query, [t.name])]


def pending(
    conn: psycopg.Connection[Any], table: str | TableName = "outbox", *, migrations: MigrationSet = OUTBOX
) -> list[Migration]:
    """Migrations not yet applied to ``table``."""
    done = set(applied_versions(conn, table, migrations=migrations))
    return [m for m in available(migrations) if m.version not in done]


def migrate(
    conn: psycopg.Connection[Any],
    table: str | TableName = "outbox",
    *,
    fresh_schema: bool = True,
    migrations: MigrationSet = OUTBOX,
) -> list[int]:
    """Bring ``table`` to the current schema; return the versions applied now.

    Runs in one transaction (PostgreSQL DDL is transactional): either every step lands or none.
    ``fresh_schema=False`` builds a new table by replaying every migration instead of using
    ``schema.sql`` (the migration test compares both).
    """
    t = TableName.parse(table)
    lock_scope = "" if migrations is OUTBOX else f"{migrations.ledger}:"
    with conn.transaction():
        conn.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
            # The outbox's lock name is the one every release takes; other sets add theirs.
            [f"outbox_celery:migrate:{lock_scope}{t.qualified}"],
        )
        if t.schema:
            conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(t.schema)))
        conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} ("
                " table_name text NOT NULL,"
                " version integer NOT NULL,"
                " name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now(),"
                " PRIMARY KEY (table_name, version))"
            ).format(_ledger(t, migrations.ledger))
        )
        done = set(applied_versions(conn, t, migrations=migrations))
        todo = [m for m in available(migrations) if m.version not in done]
        if not todo:
            return []
        if migrations is OUTBOX and not done:
            _refuse_name_clash(conn, t)
        exists = _exists(conn, t.identifier())
        if not done and exists:
            raise MigrationError(
                f"table {t.qualified} exists but has no recorded outbox-celery migrations; "
                "refusing to guess its schema"
            )
        if not done and fresh_schema:
            conn.execute(migrations.compose(_sql.read(migrations.schema), t))
        else:
            for m in todo:
                conn.execute(migrations.compose(m.text, t))
        insert = sql.SQL("INSERT INTO {} (table_name, version, name) VALUES (%s, %s, %s)").format(
            _ledger(t, migrations.ledger)
        )
        for m in todo:
            conn.execute(insert, [t.name, m.version, m.name])
        return [m.version for m in todo]
