"""The Django app of outbox-celery: add ``"outbox_celery.contrib.django"`` to ``INSTALLED_APPS``.

* :func:`enqueue` / :func:`enqueue_many`: the core functions on Django's own connection, inside
  ``transaction.atomic()`` (a rolled-back block, or a rolled-back savepoint, leaves no event).
* ``manage.py migrate`` creates and upgrades the outbox table with the library's own
  :func:`outbox_celery.migrate` (one source of truth for the schema).
* The admin lists, filters and explains messages and requeues or skips dead ones with the same
  rules as the ``outbox-celery`` CLI.

Settings: ``CELERY_OUTBOX_TABLE`` (shared with the Celery side), ``OUTBOX_DATABASE`` (the alias
holding the table), ``CELERY_OUTBOX_MAX_PAYLOAD_BYTES``. See docs/django.md.

This module does not import models, so ``settings.py`` and the Celery app module may import
:func:`outbox_dsn` (or :func:`database_dsn`) from it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import psycopg
from django.db import connections

from ...errors import ProducerError
from ...produce import enqueue as producer
from ...produce.enqueue import Event
from .conf import database_dsn, max_payload_bytes, outbox_database, outbox_dsn, outbox_table

__all__ = [
    "Event",
    "database_dsn",
    "enqueue",
    "enqueue_group",
    "enqueue_many",
    "outbox_connection",
    "outbox_dsn",
]


def outbox_connection(using: str | None = None) -> psycopg.Connection[Any]:
    """The psycopg 3 connection under Django's connection ``using``, checked for a producer.

    Refuses (:class:`~outbox_celery.ProducerError`) unless the alias is inside
    ``transaction.atomic(using=...)`` that is not marked for rollback: outside one, Django is in
    autocommit and the event would commit on its own, apart from the business data.
    """
    alias = using or outbox_database()
    wrapper = connections[alias]
    if wrapper.vendor != "postgresql":
        raise ProducerError(f"database {alias!r} is {wrapper.vendor}; the outbox needs PostgreSQL")
    if not wrapper.in_atomic_block:
        raise ProducerError(
            f"enqueue() must run inside transaction.atomic(using={alias!r}): outside it Django "
            "autocommits, so the event would commit on its own, apart from your business data"
        )
    if wrapper.needs_rollback:
        raise ProducerError(
            "this atomic block is marked for rollback (an error was caught inside it); "
            "the event would be rolled back too"
        )
    wrapper.ensure_connection()
    conn = wrapper.connection
    if not isinstance(conn, psycopg.Connection):
        raise ProducerError(
            f"database {alias!r} runs on {type(conn).__module__}; the outbox needs Django's "
            "PostgreSQL backend on psycopg 3 (pip install 'psycopg[binary]')"
        )
    return conn


def _options(options: dict[str, Any]) -> dict[str, Any]:
    if "allow_autocommit" in options:
        raise ProducerError("allow_autocommit is not available here: Django's enqueue requires atomic()")
    options.setdefault("table", outbox_table())
    options.setdefault("max_payload_bytes", max_payload_bytes())
    return options


def enqueue(
    *,
    event_type: str,
    payload: Any,
    aggregate_type: str,
    aggregate_id: str | int,
    using: str | None = None,
    **options: Any,
) -> int:
    """Write one event in the current ``atomic()`` block of Django's connection; return its id.

    Same arguments as :func:`outbox_celery.enqueue` without the connection (``ordered``,
    ``delay``, ``ordering_key``... are passed through); ``table`` defaults to
    ``CELERY_OUTBOX_TABLE`` and ``using`` to ``OUTBOX_DATABASE``. The event belongs to the
    innermost savepoint: if that ``atomic()`` block rolls back, so does the event.

    :raises ProducerError: outside ``atomic()``, on bad input; nothing is written.
    """
    conn = outbox_connection(using)
    return producer.enqueue(
        conn,
        event_type=event_type,
        payload=payload,
        aggregate_type=aggregate_type,
        aggregate_id=aggregate_id,
        **_options(options),
    )


def enqueue_many(
    messages: Iterable[Event | Mapping[str, Any]],
    *,
    using: str | None = None,
    **options: Any,
) -> list[int]:
    """Write many events with one statement in the current ``atomic()`` block; return their ids.

    ``messages`` holds :class:`~outbox_celery.Event` objects or mappings of :func:`enqueue`'s
    keywords, as for :func:`outbox_celery.enqueue_many`.
    """
    conn = outbox_connection(using)
    return producer.enqueue_many(conn, messages, **_options(options))


def enqueue_group(
    messages: Iterable[Event | Mapping[str, Any]],
    *,
    then: Event | Mapping[str, Any],
    using: str | None = None,
    **options: Any,
) -> producer.Group:
    """Write a group and its callback in the current ``atomic()`` block (DESIGN invariant 29):
    :func:`outbox_celery.enqueue_group` on Django's connection (``skip_on_dead`` passed through)."""
    conn = outbox_connection(using)
    return producer.enqueue_group(conn, messages, then=then, **_options(options))
