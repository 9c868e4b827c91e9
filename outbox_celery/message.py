"""What handlers receive: :class:`Message`, and the row :class:`Status`."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from .outcomes import Outcome

__all__ = ["KEY_SEPARATOR", "ROUTE_SEPARATOR", "Message", "Outcome", "Status", "route", "split_route"]

#: Between an event type and a subscription's name in a route, ``order.paid@receipt`` (DESIGN
#: invariant 28): a subscription's rows carry their route as their ``event_type`` column, and
#: everything kept per event type (handler, queue, limits, pause, stats) is kept per route.
ROUTE_SEPARATOR = "@"
#: Between an ordering key and the route in a subscription's stored ordering key: each
#: subscription orders its own events per key (DESIGN invariant 28). Refused in ordering keys.
KEY_SEPARATOR = "\x1f"


def route(event_type: str, subscription: str | None) -> str:
    """The route of ``event_type``'s subscription ``subscription``: ``order.paid@receipt``, or
    the event type itself for a handler without a name."""
    return event_type if subscription is None else f"{event_type}{ROUTE_SEPARATOR}{subscription}"


def split_route(stored: str) -> tuple[str, str | None]:
    """``(event_type, subscription)`` of a row's ``event_type`` column (a route)."""
    event_type, sep, name = stored.partition(ROUTE_SEPARATOR)
    return (event_type, name) if sep else (stored, None)


class Status(enum.StrEnum):
    """Life cycle of an outbox row (see docs/design.md)."""

    PENDING = "pending"
    PROCESSING = "processing"
    DONE = "done"
    DEAD = "dead"


@dataclass(frozen=True, slots=True)
class Message:
    """One outbox event, as handed to a handler after a successful fenced start.

    :ivar id: the outbox row id.
    :ivar event_type: the routing key of the event, e.g. ``"order.created"``.
    :ivar aggregate_type: the kind of business object, e.g. ``"order"``.
    :ivar aggregate_id: the business object's id, as text.
    :ivar payload: what was enqueued, as a Celery task argument would arrive (kombu's JSON,
        DESIGN invariant 27): a ``dict`` (keys in the order given), ``list``, ``str``, ``int``,
        ``float``, ``bool``, ``None``, or a type kombu registers (``Decimal``, ``datetime``,
        ``date``, ``time``, ``UUID``, ``bytes``, :func:`outbox_celery.codec.register_type`). A
        string payload, ``json.dumps`` output included, arrives as that same ``str``.
    :ivar attempts: handler runs so far, this one included (1 on the first run).
    :ivar created_at: when the producer's transaction wrote the row (database clock).
    :ivar lease_version: the fencing token of the claim this run belongs to.
    :ivar ordering_key: set for ordered messages; ``None`` otherwise.
    :ivar idempotency_key: stable across every redelivery of this message; send it downstream
        (an ``Idempotency-Key`` header, a message id) so the receiver can de-duplicate. It is
        ``<instance>/<schema>.<table>:<id>``: the table's identity (a UUID drawn once by
        migration 0006, so two databases never share keys), then the table as PostgreSQL
        resolves it, e.g. ``1b4e...c2/public.outbox:42``, whether the outbox was configured as
        ``outbox`` or ``public.outbox``.
    :ivar legacy_idempotency_key: the key releases before migration 0006 sent for this message
        (``public.outbox:42``), for receivers that stored those: see
        :func:`outbox_celery.inbox.first_time`'s ``previous_key``.
    :ivar trace_context: the producer's trace context, or ``None``.
    :ivar subscription: the name of the subscription this delivery belongs to
        (``@outbox.handler("order.paid", name="receipt")``), ``None`` for a handler without a
        name. ``event_type`` is the event's own (``"order.paid"``) either way.
    :ivar database: the name of the database the message lives in when its Outbox serves
        several (``Outbox(databases=...)``, docs/databases.md); ``None`` with one ``dsn``.
    """

    id: int
    event_type: str
    aggregate_type: str
    aggregate_id: str
    payload: Any
    attempts: int
    created_at: datetime
    lease_version: int
    ordering_key: str | None
    idempotency_key: str
    _extend: Callable[[float], bool] | None = field(default=None, repr=False, compare=False)
    #: The producer's trace context (W3C ``traceparent``...), when it had one: see
    #: :mod:`outbox_celery.tracing`.
    trace_context: dict[str, str] | None = field(default=None, repr=False, compare=False)
    legacy_idempotency_key: str = field(default="", repr=False, compare=False)
    subscription: str | None = None
    #: The group this message is a member of (DESIGN invariant 29), or ``None``.
    group_id: int | None = field(default=None, compare=False)
    #: The name of the database the message lives in, when its Outbox serves several
    #: (``Outbox(databases=...)``, docs/databases.md); ``None`` with one ``dsn``.
    database: str | None = None

    @property
    def route(self) -> str:
        """Where this delivery goes: ``order.paid@receipt`` for a subscription, else the event
        type (the key of the handler table, the flow-control and the stats, invariant 28)."""
        return route(self.event_type, self.subscription)

    def extend_lease(self, seconds: float) -> bool:
        """Ask for ``seconds`` more of lease from now (database clock), fenced.

        Returns ``False`` when the lease was lost (another claim superseded this one): the
        handler should stop, its result will not be recorded. Note that Celery's task time
        limit is not extended.
        """
        if self._extend is None:
            raise RuntimeError("this message is not bound to a running delivery")
        return self._extend(seconds)


def idempotency_key(table: str, outbox_id: int, instance: str | None = None) -> str:
    """The stable idempotency key of message ``outbox_id`` in ``table``.

    ``table`` is the schema-qualified name as PostgreSQL resolves it (``public.outbox``, see
    :meth:`~outbox_celery.db.store.Store.canonical_name`), so each message has exactly one key.
    ``instance`` is the table's identity (a UUID written by migration 0006):
    ``<instance>/public.outbox:42``, distinct across databases and clusters. Without it, the
    key of earlier releases (``public.outbox:42``).
    """
    return f"{instance}/{table}:{outbox_id}" if instance else f"{table}:{outbox_id}"
