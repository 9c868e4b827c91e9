"""What the operator tools read of an Outbox: its name, app, settings, handlers and connections.

The command line, the console and the metrics collector operate an
:class:`~outbox_celery.app.outbox.Outbox` without importing the Celery side
(:mod:`outbox_celery.app`): the Outbox subclasses :class:`OperatedOutbox`, so
``isinstance(value, OperatedOutbox)`` tells an Outbox from anything else a module holds, and the
tools type what they read with it.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

import psycopg

from .config import OutboxConfig
from .databases import Database
from .handlers import HandlerSpec

__all__ = ["OperatedOutbox"]


class OperatedOutbox(abc.ABC):
    """An outbox table bound to a Celery app, as the operator tools see it."""

    #: Prefix of its task names and beat entries; tells the outboxes of one app apart.
    name: str
    #: The Celery app it is bound to.
    app: Any

    @property
    @abc.abstractmethod
    def config(self) -> OutboxConfig:
        """Its resolved settings (the database, the table, the intervals...)."""

    @property
    @abc.abstractmethod
    def handlers(self) -> Mapping[str, HandlerSpec]:
        """Its handlers by route: the event type, or ``<event_type>@<name>`` for a subscription."""

    @abc.abstractmethod
    def queue_for(self, event_type: str) -> str:
        """The queue the delivery tasks of ``event_type`` are routed to."""

    @property
    def databases(self) -> Mapping[str, Database]:
        """The databases it serves by name when it serves several (``databases=``); empty
        with one ``dsn``."""
        return {}

    @abc.abstractmethod
    def connection(self, database: str | None = None) -> AbstractContextManager[psycopg.Connection[Any]]:
        """A connection to its database, or to ``database`` when it serves several (from its pool)."""
