"""Smoke test of an installed wheel, run by the clean virtualenv's Python outside the source tree.

Checks that the package imports from site-packages (not from a checkout), that its version is
the one the wheel's metadata declares, that the data files it needs at run time are installed
(the SQL files, the migrations, py.typed), and that the console script answers ``--help``. With
``OUTBOX_SMOKE_DSN`` set it also migrates a table of its own, enqueues one event, claims it and
drops the table.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from importlib import metadata, resources
from pathlib import Path


def main() -> None:
    import outbox_celery

    where = Path(outbox_celery.__file__).resolve()
    assert "site-packages" in where.parts, f"imported from {where}, not from the installed wheel"
    version = metadata.version("outbox-celery")
    assert outbox_celery.__version__ == version, (outbox_celery.__version__, version)

    sql = resources.files("outbox_celery") / "db" / "sql"
    names = ("schema.sql", "queries.sql", "admin.sql", "console.sql", "subscriptions.sql")
    for name in (*names, "inbox/schema.sql", "inbox/queries.sql"):
        assert (sql / name).is_file(), f"sql/{name} is missing from the wheel"
    migrations = sorted(p.name for p in (sql / "migrations").iterdir() if p.name.endswith(".sql"))
    assert migrations and migrations[0].startswith("0001_"), migrations
    assert (resources.files("outbox_celery") / "py.typed").is_file(), "py.typed is missing"

    script = Path(sys.executable).with_name("outbox-celery")
    shown = subprocess.run([script, "--help"], capture_output=True, text=True, check=True).stdout
    assert "migrate" in shown and "stats" in shown, shown
    said = subprocess.run([script, "--version"], capture_output=True, text=True, check=True).stdout
    assert version in said, said
    n = len(migrations)
    print(f"outbox-celery {version}: imports, data files and `outbox-celery --help` ok ({n} migrations)")

    dsn = os.environ.get("OUTBOX_SMOKE_DSN")
    if not dsn:
        print("OUTBOX_SMOKE_DSN unset: the database step is skipped")
        return
    import psycopg
    import psycopg.sql

    from outbox_celery import Event, Store, enqueue_many, migrate
    from outbox_celery.claim.executor import claim

    # A schema of its own (the table, its flow tables and the migrations ledger), dropped after.
    schema = f"outbox_smoke_{uuid.uuid4().hex[:8]}"
    table = f"{schema}.outbox"
    env = {**os.environ, "OUTBOX_DSN": dsn, "OUTBOX_TABLE": table}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(psycopg.sql.SQL("CREATE SCHEMA {}").format(psycopg.sql.Identifier(schema)))
        try:
            # The console script migrates, as an operator would; the library enqueues and claims.
            subprocess.run([script, "migrate"], env=env, capture_output=True, text=True, check=True)
            with conn.transaction():
                enqueue_many(conn, [Event("smoke.checked", {"n": 1}, "smoke", "1")], table=table)
            run = claim(Store(table), conn, limit=10, lease=30, owner="smoke", max_attempts=3)
            claimed = run.claimed
            assert [c.event_type for c in claimed] == ["smoke.checked"], claimed
            assert migrate(conn, table) == []  # up to date: nothing left to apply
        finally:
            conn.execute(psycopg.sql.SQL("DROP SCHEMA {} CASCADE").format(psycopg.sql.Identifier(schema)))
    print(f"migrate, enqueue and claim ok against the database (schema {schema}, dropped)")


if __name__ == "__main__":
    main()
