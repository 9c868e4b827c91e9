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

from ...config import TableName
from ...errors import ConfigurationError
from ...producer import DEFAULT_MAX_PAYLOAD_BYTES

__all__ = ["database_dsn", "max_payload_bytes", "outbox_database", "outbox_table"]


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


def database_dsn(database: Mapping[str, Any]) -> str:
    """A libpq connection string for one entry of ``settings.DATABASES``.

    Meant for ``settings.py``, where Django is not set up yet::

        CELERY_OUTBOX_DSN = database_dsn(DATABASES["default"])

    so the workers connect to the database the Django app writes to. ``NAME``, ``USER``,
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
