"""An unmanaged, read-only model over the outbox table, for the admin and for queries.

The table belongs to the library (created by :func:`outbox_celery.migrate`); Django never
creates, alters or writes it. Rows change state only through the library's fenced SQL
(claim, finalize, the operator functions of :mod:`outbox_celery.ops`): saving or deleting a
model instance raises, because an ORM write would bypass the lease fence (invariant 4).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, NoReturn

from django.db import models

from ...errors import OutboxError
from .conf import model_db_table

__all__ = ["OutboxGroup", "OutboxMessage", "Status"]


class Status(models.TextChoices):
    """The four states of a message (docs/design.md)."""

    PENDING = "pending"
    PROCESSING = "processing"
    DONE = "done"
    DEAD = "dead"


class ReadOnlyError(OutboxError):
    """An ORM write to the outbox table was attempted."""


class PayloadField(models.JSONField):
    """The ``json`` payload column (migration 0010), as stored: kombu's typed values stay their
    ``{"__type__": ..., "__value__": ...}`` objects, which is what the admin shows.

    Both drivers decode a ``json`` column themselves (Django hands only ``jsonb`` over as text),
    so the value is taken as they give it; decoding it again would turn a string payload such as
    ``"1"`` into a number. Key lookups (``payload__order_id``) compare ``jsonb`` and do not apply
    to this column; search with ``payload::jsonb`` in SQL (docs/design.md, "The payload").
    """

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        return value


class OutboxMessage(models.Model):
    """One row of the outbox table (``CELERY_OUTBOX_TABLE``)."""

    id: models.BigAutoField[int, int] = models.BigAutoField(primary_key=True)
    event_type: models.TextField[str, str] = models.TextField()
    aggregate_type: models.TextField[str, str] = models.TextField()
    aggregate_id: models.TextField[str, str] = models.TextField()
    payload: PayloadField = PayloadField()
    ordering_key: models.TextField[str | None, str | None] = models.TextField(null=True, blank=True)
    created_at: models.DateTimeField[datetime, datetime] = models.DateTimeField()
    status: models.TextField[str, str] = models.TextField(choices=Status.choices)
    available_at: models.DateTimeField[datetime, datetime] = models.DateTimeField()
    attempts: models.IntegerField[int, int] = models.IntegerField()
    lease_owner: models.TextField[str | None, str | None] = models.TextField(null=True, blank=True)
    lease_until: models.DateTimeField[datetime | None, datetime | None] = models.DateTimeField(
        null=True, blank=True
    )
    lease_version: models.BigIntegerField[int, int] = models.BigIntegerField()
    started_version: models.BigIntegerField[int, int] = models.BigIntegerField()
    head: models.BooleanField[bool, bool] = models.BooleanField()
    dedup_key: models.TextField[str | None, str | None] = models.TextField(null=True, blank=True)
    trace_context: models.JSONField[Any, Any] = models.JSONField(null=True, blank=True)
    limit_key: models.TextField[str | None, str | None] = models.TextField(null=True, blank=True)
    #: A subscription's row reads the payload of this row (migration 0011, DESIGN invariant 28).
    payload_of: models.BigIntegerField[int | None, int | None] = models.BigIntegerField(null=True, blank=True)
    last_error: models.TextField[str | None, str | None] = models.TextField(null=True, blank=True)
    #: One entry per failed attempt, the last 20 (``attempt``, ``at``, ``error``; migration 0013,
    #: DESIGN invariant 32); ``None`` while the message never failed.
    errors: models.JSONField[Any, Any] = models.JSONField(null=True, blank=True)
    done_at: models.DateTimeField[datetime | None, datetime | None] = models.DateTimeField(
        null=True, blank=True
    )

    class Meta:
        managed = False
        db_table = model_db_table()
        verbose_name = "outbox message"
        verbose_name_plural = "outbox messages"

    def __str__(self) -> str:
        return f"#{self.pk} {self.event_type} ({self.status})"

    def stored_payload(self) -> Any:
        """The payload, or, on a subscription's row (DESIGN invariant 28), the row it reads it from's."""
        if self.payload is not None or self.payload_of is None:
            return self.payload
        owner = type(self)._default_manager.using(self._state.db).filter(pk=self.payload_of)
        return owner.values_list("payload", flat=True).first()

    def save(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Refuse: rows change only through the library's fenced SQL."""
        raise ReadOnlyError("outbox rows are written by outbox_celery.enqueue and the workers only")

    def delete(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Refuse: done rows are purged by retention, live rows are never deleted."""
        raise ReadOnlyError("outbox rows are purged by the retention task (outbox-celery purge)")


class OutboxGroup(models.Model):
    """One group with a callback (``<CELERY_OUTBOX_TABLE>_group``, migration 0012, DESIGN
    invariant 29): its progress and state. Read-only: groups are counted by the fenced finalize
    and closed by hand through :func:`outbox_celery.ops.finish_group` and
    :func:`~outbox_celery.ops.cancel_group` (the admin's actions)."""

    id: models.BigAutoField[int, int] = models.BigAutoField(primary_key=True)
    total: models.IntegerField[int, int] = models.IntegerField()
    done: models.IntegerField[int, int] = models.IntegerField()
    dead: models.IntegerField[int, int] = models.IntegerField()
    state: models.TextField[str, str] = models.TextField()
    skip_on_dead: models.BooleanField[bool, bool] = models.BooleanField()
    event_type: models.TextField[str, str] = models.TextField()
    dead_members: models.JSONField[Any, Any] = models.JSONField()
    callback_id: models.BigIntegerField[int | None, int | None] = models.BigIntegerField(null=True)
    created_at: models.DateTimeField[datetime, datetime] = models.DateTimeField()
    closed_at: models.DateTimeField[datetime | None, datetime | None] = models.DateTimeField(null=True)
    note: models.TextField[str | None, str | None] = models.TextField(null=True)

    class Meta:
        managed = False
        db_table = model_db_table() + "_group"
        verbose_name = "outbox group"
        verbose_name_plural = "outbox groups"

    def __str__(self) -> str:
        return f"group #{self.pk} ({self.state}, {self.done + self.dead} of {self.total})"

    def save(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Refuse: a group changes only through the library's SQL."""
        raise ReadOnlyError("outbox groups are written by outbox_celery.enqueue_group and the finalize only")

    def delete(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Refuse: cancel it instead (its callback is then never enqueued)."""
        raise ReadOnlyError("outbox groups are not deleted; cancel one with outbox-celery groups cancel")
