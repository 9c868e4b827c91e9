"""Run the library's own :func:`outbox_celery.migrate` on a Django database alias."""

from __future__ import annotations

import logging
from typing import Any

from django.db import connections

from ...db.migrations import applied_versions, migrate
from .conf import outbox_database, outbox_table

logger = logging.getLogger(__name__)


def migrate_outbox(using: str, *, create: bool = True) -> list[int]:
    """Bring the outbox table (``CELERY_OUTBOX_TABLE``) on alias ``using`` to the current schema.

    Does nothing on an alias other than ``OUTBOX_DATABASE``. With ``create=False`` a table never
    migrated is left alone. Returns the versions applied now.
    """
    if using != outbox_database():
        return []
    wrapper = connections[using]
    wrapper.ensure_connection()
    conn: Any = wrapper.connection
    table = outbox_table()
    if not create and not applied_versions(conn, table):
        return []
    applied = migrate(conn, table)
    if applied:
        logger.info("outbox table %s: applied migrations %s", table, applied)
    return applied


def forwards(apps: Any, schema_editor: Any) -> None:
    """``RunPython`` forward step: create or upgrade the table with the library's SQL."""
    migrate_outbox(schema_editor.connection.alias)


def backwards(apps: Any, schema_editor: Any) -> None:
    """``RunPython`` reverse step: nothing. Unapplying never drops the table or its events."""
