"""What the Django app reads from ``django.conf.settings``.

The table name is the one the Celery side reads (``CELERY_OUTBOX_TABLE`` through
``app.config_from_object("django.conf:settings", namespace="CELERY")``), so the producer, the
migration, the admin and the workers can never disagree about it. The database alias is a
Django notion only: ``OUTBOX_DATABASE``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS
from psycopg.conninfo import make_conninfo

from ...errors import ConfigurationError
from ...produce.enqueue import DEFAULT_MAX_PAYLOAD_BYTES
from ...table import TableName

__all__ = ["database_dsn", "max_payload_bytes", "outbox_database", "outbox_dsn", "outbox_table"]


def outbox_table() -> TableName:
    """``CELERY_OUTBOX_TABLE`` (``"name"`` or ``"schema.name"``), default ``"outbox"``."""
    return TableName.parse(getattr(settings, "CELERY_OUTBOX_TABLE", None) or "outbox")


def model_db_table() -> str:
    """``db_table`` of the model over the table (``CELERY_OUTBOX_TABLE``).

    Django quotes ``db_table`` as one identifier; for ``schema.name`` this spelling makes it
    ``"schema"."name"``.
    """
    table = outbox_table()
    return f'{table.schema}"."{table.name}' if table.schema else table.name


def outbox_database() -> str:
    """``OUTBOX_DATABASE``: the alias in ``DATABASES`` that holds the outbox table (``"default"``)."""
    alias = getattr(settings, "OUTBOX_DATABASE", None) or DEFAULT_DB_ALIAS
    if alias not in settings.DATABASES:
        raise ConfigurationError(f"OUTBOX_DATABASE={alias!r} is not an alias of settings.DATABASES")
    return str(alias)


def max_payload_bytes() -> int:
    """``CELERY_OUTBOX_MAX_PAYLOAD_BYTES`` (the limit the core ``enqueue`` applies), default 1 MiB."""
    value = getattr(settings, "CELERY_OUTBOX_MAX_PAYLOAD_BYTES", None)
    return DEFAULT_MAX_PAYLOAD_BYTES if value is None else int(value)


def outbox_dsn(alias: str | None = None) -> str:
    """The libpq connection string of ``OUTBOX_DATABASE`` (or ``alias``), for the Celery app.

    The documented way::

        # proj/celery.py
        outbox = Outbox(app, dsn=outbox_dsn())

    The DSN, password included, then lives in the Outbox object only: never in a setting,
    where ``celery report``, ``celery inspect conf`` and Django's debug page would print it
    (Django masks ``DATABASES[...]["PASSWORD"]``, neither of them masks ``CELERY_OUTBOX_DSN``).
    Reads ``settings.DATABASES``: call it once ``DJANGO_SETTINGS_MODULE`` is set.
    """
    return database_dsn(settings.DATABASES[alias or outbox_database()])


def database_dsn(database: Mapping[str, Any]) -> str:
    """A libpq connection string for one entry of ``settings.DATABASES``.

    Prefer :func:`outbox_dsn` in the Celery app module. Assigned to a setting
    (``CELERY_OUTBOX_DSN = database_dsn(DATABASES["default"])``, as earlier releases
    documented), a password in it is printed by ``celery report`` and Django's debug page, and the
    worker warns at start-up. ``NAME``, ``USER``,
    ``PASSWORD``, ``HOST``, ``PORT`` and ``OPTIONS`` (libpq parameters such as ``sslmode``;
    Django-only keys like ``pool`` or ``isolation_level`` are left out) are used.
    """
    engine = str(database.get("ENGINE", ""))
    if not engine.endswith("postgresql"):
        raise ConfigurationError(f"the outbox needs the PostgreSQL backend, got ENGINE={engine!r}")
    params: dict[str, Any] = {}
    for key, libpq in (("NAME", "dbname"), ("USER", "user"), ("PASSWORD", "password"), ("HOST", "host")):
        if database.get(key):
            params[libpq] = str(database[key])
    if database.get("PORT"):
        params["port"] = str(database["PORT"])
    django_only = {"pool", "isolation_level", "server_side_binding", "assume_role", "cursor_factory"}
    for key, value in (database.get("OPTIONS") or {}).items():
        if key not in django_only and value is not None:
            params[key] = str(value)
    return make_conninfo("", **params)
