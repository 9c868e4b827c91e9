"""``manage.py migrate`` builds and upgrades the outbox table with the library's own SQL."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from django.core.management import call_command
from django.db import connection
from django.db.migrations.recorder import MigrationRecorder
from django.test.utils import override_settings
from integration.test_migrations import _replay_up_to, schema_dump

from outbox_celery import enqueue, migrate
from outbox_celery.db.migrations import MigrationError, applied_versions, available

ALL = [m.version for m in available()]


def _reference(dsn: str) -> dict[str, object]:
    """The schema ``outbox_celery.migrate`` builds for a table named ``outbox``."""
    with psycopg.connect(dsn, autocommit=True) as c:
        migrate(c, "reference.outbox")
        return schema_dump(c, "reference.outbox")


def test_migrate_from_an_empty_database_builds_the_library_schema(django_dsn: str) -> None:
    call_command("migrate", run_syncdb=True, verbosity=0)
    with psycopg.connect(django_dsn, autocommit=True) as c:
        assert applied_versions(c, "outbox") == ALL
        assert schema_dump(c, "outbox") == _reference(django_dsn)
    assert ("outbox_celery", "0001_outbox_table") in MigrationRecorder(connection).applied_migrations()


def test_migrate_adopts_a_table_created_by_the_cli_and_keeps_its_rows(django_dsn: str) -> None:
    cli = Path(sys.executable).parent / "outbox-celery"
    done = subprocess.run(
        [str(cli), "--dsn", django_dsn, "migrate"], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    with psycopg.connect(django_dsn) as c:
        kept = enqueue(c, event_type="before.django", payload={}, aggregate_type="a", aggregate_id=1)
    call_command("migrate", run_syncdb=True, verbosity=0)
    call_command("migrate", run_syncdb=True, verbosity=0)  # twice: nothing to do
    with psycopg.connect(django_dsn, autocommit=True) as c:
        assert applied_versions(c, "outbox") == ALL
        assert [r[0] for r in c.execute("SELECT id FROM outbox").fetchall()] == [kept]


@pytest.mark.skipif(len(ALL) < 2, reason="needs a release with more than one migration")
def test_every_migrate_upgrades_a_table_left_behind_by_an_older_release(django_dsn: str) -> None:
    """The Django migration ran long ago (older library); new SQL files still get applied."""
    with psycopg.connect(django_dsn, autocommit=True) as c:
        _replay_up_to(c, "outbox", ALL[0])
        assert applied_versions(c, "outbox") == ALL[:1]
    MigrationRecorder(connection).record_applied("outbox_celery", "0001_outbox_table")
    call_command("migrate", run_syncdb=True, verbosity=0)
    with psycopg.connect(django_dsn, autocommit=True) as c:
        assert applied_versions(c, "outbox") == ALL
        assert schema_dump(c, "outbox") == _reference(django_dsn)


def test_migrate_uses_the_configured_table_name(django_dsn: str) -> None:
    with override_settings(CELERY_OUTBOX_TABLE="shop.Events"):
        call_command("migrate", run_syncdb=True, verbosity=0)
    with psycopg.connect(django_dsn, autocommit=True) as c:
        assert applied_versions(c, "shop.Events") == ALL
        assert applied_versions(c, "outbox") == []


def test_unapplying_the_migration_keeps_the_table_and_its_events(django_db: str) -> None:
    with psycopg.connect(django_db) as c:
        kept = enqueue(c, event_type="x", payload={}, aggregate_type="a", aggregate_id=1)
    call_command("migrate", "outbox_celery", "zero", verbosity=0)
    assert ("outbox_celery", "0001_outbox_table") not in MigrationRecorder(connection).applied_migrations()
    with psycopg.connect(django_db, autocommit=True) as c:
        assert [r[0] for r in c.execute("SELECT id FROM outbox").fetchall()] == [kept]
    call_command("migrate", verbosity=0)
    assert ("outbox_celery", "0001_outbox_table") in MigrationRecorder(connection).applied_migrations()


def test_an_unrelated_table_of_that_name_is_refused_not_guessed(django_dsn: str) -> None:
    with psycopg.connect(django_dsn, autocommit=True) as c:
        c.execute("CREATE TABLE outbox (id int)")
    with pytest.raises(MigrationError, match="refusing to guess"):
        call_command("migrate", run_syncdb=True, verbosity=0)


def test_the_model_state_needs_no_new_django_migration(django_db: str) -> None:
    """The unmanaged model and the shipped migration agree (no makemigrations drift)."""
    call_command("makemigrations", "outbox_celery", check=True, dry_run=True, verbosity=0)
