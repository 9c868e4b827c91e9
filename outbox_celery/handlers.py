"""Handler registration: what ``@outbox.handler(...)`` checks and records.

:func:`register_handler` validates a handler's options once, at registration (a bad option is a
:class:`~outbox_celery.errors.ConfigurationError` where the handler is declared, not at its
first delivery), and records a :class:`HandlerSpec` in the outbox's handler table, which the
claimer, the publisher and the deliverer read. Declaration data only: no engine, no Celery.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from .errors import ConfigurationError, seconds
from .flow import Limit
from .message import ROUTE_SEPARATOR, Message, route, split_route
from .transactional import TransactionKind, transaction_kind

__all__ = [
    "MAX_BATCH",
    "MAX_PACK",
    "MAX_WAIT",
    "BatchResult",
    "Handler",
    "HandlerSpec",
    "TransactionalHandler",
    "register_handler",
    "subscription_route",
]

Handler = Callable[[Message], Any]
#: A transactional handler: ``(message, conn)``, inside the transaction of its fenced done.
TransactionalHandler = Callable[[Message, Any], Any]
#: What a batch handler may return: ``None`` (every message delivered) or, for the messages that
#: were not, their id -> a RetryableError, Defer or PermanentError instance.
BatchResult = Mapping[int, BaseException] | None


@dataclass(frozen=True, slots=True)
class HandlerSpec:
    """A registered handler and the queue its route is sent to.

    :ivar transaction: set for a transactional handler (``fn`` then takes ``(message, conn)``
        and runs inside the transaction of its fenced done, DESIGN invariant 20).
    :ivar batch: set for a batch handler (DESIGN invariant 21): ``fn`` takes a list of up
        to ``batch`` messages of this event type and returns ``None`` or a mapping from message
        id to the outcome of those that did not succeed.
    :ivar limit: the event type's global limits, enforced by the claim (docs/flow-control.md).
    """

    event_type: str
    fn: Callable[..., Any]
    queue: str
    transaction: TransactionKind | None = None
    batch: int | None = None
    #: Global concurrency and rate limits of the event type (DESIGN invariant 22).
    limit: Limit | None = None
    #: Seconds a batch handler's due rows may wait for a fuller batch; 0: never wait.
    max_wait: float = 0.0
    #: Rows of a one-message handler one delivery task may carry (invariant 30); 1: one each.
    pack: int = 1


F = TypeVar("F", bound=Callable[..., Any])

# The largest batch a batch handler may ask for: the task carries two arrays of this size.
MAX_BATCH = 1000
# The largest pack of a one-message handler: its handlers run one after another in one task.
MAX_PACK = 100
# Longest max_wait of a batch handler: a batch fills briefly, never for long.
MAX_WAIT = 5.0


def register_handler(
    handlers: dict[str, HandlerSpec],
    event_type: str,
    *,
    name: str | None = None,
    queue: str | None = None,
    transactional: bool | str = False,
    session_factory: Callable[[], Any] | None = None,
    using: str | None = None,
    batch: int | None = None,
    max_wait: float | timedelta | None = None,
    pack: int | None = None,
    concurrency: int | None = None,
    rate: str | float | None = None,
    key_concurrency: int | None = None,
    key_rate: str | float | None = None,
) -> Callable[[F], F]:
    """Check the options of ``event_type``'s handler; the decorator records it in ``handlers``.

    What :meth:`Outbox.handler <outbox_celery.app.outbox.Outbox.handler>` does: one handler per
    event type, or one per named subscription of it (DESIGN invariant 28).

    The handler receives a :class:`~outbox_celery.message.Message` and runs outside any
    database transaction. It raises :class:`~outbox_celery.errors.RetryableError`,
    :class:`~outbox_celery.errors.PermanentError` or :class:`~outbox_celery.errors.Defer` to
    say what happened; returning normally means delivered.

    A *transactional* handler (docs/transactional.md, DESIGN invariant 20) receives
    ``(message, conn)`` and runs inside one transaction on the outbox's database whose last
    statement is the fenced ``done``: its writes (and the events it enqueues on ``conn``)
    commit exactly when the done does. A run whose claim was superseded, or that raises,
    rolls them back.

    :param name: make it the subscription ``name`` of ``event_type`` (docs/subscriptions.md,
        DESIGN invariant 28): the event is delivered to every subscription of its type, each
        with its own rows (attempts, backoff, dead letters), queue, options, limits, pause and
        order per key, recorded under the route ``<event_type>@<name>`` (the key of
        :attr:`Outbox.handlers`). An event type has either one handler without a name or named
        subscriptions, never both. Neither may contain ``@``.
    :param queue: the Celery queue its delivery tasks go to (default: ``default_queue``).
    :param transactional: ``False`` (default), ``True`` or ``"psycopg"`` (``conn`` is a
        ``psycopg.Connection`` of the outbox's pool), ``"sqlalchemy"`` (``conn`` is a
        ``Session`` from ``session_factory``) or ``"django"`` (``conn`` is Django's
        connection, the handler runs inside ``transaction.atomic()``).
    :param session_factory: with ``transactional="sqlalchemy"``: returns a new ``Session``
        on the outbox's database (psycopg 3 dialect), e.g. a ``sessionmaker``.
    :param using: with ``transactional="django"``: the database alias (default
        ``"default"``).
    :param batch: make it a *batch handler* (docs/batch.md, DESIGN invariant 21): it receives
        a list of up to ``batch`` messages of ``event_type`` (sorted by id), carried by one
        Celery task, started and finished by one fenced statement each. It returns ``None``
        (every message delivered) or a mapping from message id to a
        :class:`~outbox_celery.errors.RetryableError`, :class:`~outbox_celery.errors.Defer`
        or :class:`~outbox_celery.errors.PermanentError` instance for those that were not;
        an exception it raises applies to the whole batch. An int from 1 to
        :data:`MAX_BATCH`; not with ``transactional``. A batch is cut from one claim, so
        it holds at most ``batch_size`` rows and at most one message per ordering key.
    :param max_wait: with ``batch``: seconds (0 to :data:`MAX_WAIT`, or a ``timedelta``)
        that due unordered messages of ``event_type`` may wait for a fuller batch: a claim
        leaves them while they are fewer than a batch and the oldest has been due less than
        this (database clock), and the push listener claims again when it has. Default 0,
        never wait. Not with ``concurrency`` or ``rate`` (docs/batch.md).
    :param pack: let one Celery task carry up to ``pack`` rows of ``event_type`` that one
        claim handed out together (docs/batch.md#packs, DESIGN invariant 30): one fenced start
        for them all, then the handler called once per message, one after another, each
        outcome written as for a task of its own. Fewer tasks and commits per message for a
        fast handler; a slow one delays the messages packed behind it (a pack starts no
        handler after a tenth of its lease: the rest go back to pending at once). A row that
        has spent an attempt travels alone. An int from 1 (default: one task per row) to
        :data:`MAX_PACK`; not with ``batch``, ``concurrency`` or ``key_concurrency``.
    :param concurrency: at most this many live deliveries of ``event_type`` at once, across
        every worker and machine (claimed or running rows under a live lease; a worker that
        dies gives its slot back when its lease ends). Enforced by the claim, which hands
        out no more (docs/flow-control.md, DESIGN invariant 22). Default: no bound.
    :param rate: at most this many deliveries of ``event_type`` start per second, across
        every worker: Celery's rate forms ``"50/s"``, ``"3000/m"``, ``"10/h"``, or a number
        (per second). Enforced by the claim with a token bucket holding ``max(1, rate x
        0.2 s)`` starts. Default: no bound. A bad value raises
        :class:`~outbox_celery.errors.ConfigurationError` (a ``ValueError``).
    :param key_concurrency: at most this many live deliveries per limit key (the
        ``limit_key`` given at enqueue: a tenant, a downstream host), counted as
        ``concurrency`` is; the claim takes the type's keyed rows key by key, round robin,
        so one busy key does not starve the others (DESIGN invariant 24). Default: no bound.
    :param key_rate: at most this many deliveries per limit key start per second (rate
        forms as ``rate``), a token bucket per key kept in the database. Default: no bound.
    """
    if not isinstance(event_type, str) or not event_type:
        raise ConfigurationError("event_type must be a non-empty string")
    key = subscription_route(event_type, name)
    _check_batch(event_type, batch, transactional=transactional)
    _check_pack(event_type, pack, batch=batch, concurrency=concurrency, key_concurrency=key_concurrency)
    kind = transaction_kind(transactional, session_factory=session_factory, using=using)
    limit = Limit.declared(
        concurrency=concurrency, rate=rate, key_concurrency=key_concurrency, key_rate=key_rate
    )
    wait = _max_wait(event_type, max_wait, batch=batch, limited=limit is not None)

    def register(fn: F) -> F:
        if key in handlers:
            raise ConfigurationError(f"a handler for {key!r} is already registered")
        _refuse_mixing(handlers, event_type, name)
        spec = HandlerSpec(
            key, fn, queue or "", transaction=kind, batch=batch, limit=limit, max_wait=wait, pack=pack or 1
        )
        handlers[key] = spec
        return fn

    return register


def _check_batch(event_type: str, batch: int | None, *, transactional: bool | str) -> None:
    """``batch`` checked (invariant 21): an int from 1 to :data:`MAX_BATCH`, not transactional."""
    if batch is None:
        return
    if isinstance(batch, bool) or not isinstance(batch, int):
        raise ConfigurationError(f"batch must be an int from 1 to {MAX_BATCH}, not {batch!r}")
    if not 1 <= batch <= MAX_BATCH:
        raise ConfigurationError(f"batch must be from 1 to {MAX_BATCH}, not {batch}")
    if transactional is not False:
        raise ConfigurationError(
            f"the handler of {event_type!r} cannot be both batch= and transactional=: a "
            "transactional handler commits one message's writes with its done (DESIGN "
            "invariant 20); register a plain batch handler, or a transactional one-message "
            "handler"
        )


def _max_wait(
    event_type: str, max_wait: float | timedelta | None, *, batch: int | None, limited: bool
) -> float:
    """``max_wait`` checked, in seconds: for a batch handler of no limit, at most :data:`MAX_WAIT`."""
    wait = 0.0 if max_wait is None else seconds(max_wait, "max_wait", error=ConfigurationError)
    if wait and batch is None:
        raise ConfigurationError(f"max_wait is for batch handlers: give {event_type!r} batch= too")
    if wait > MAX_WAIT:
        raise ConfigurationError(
            f"max_wait must be at most {MAX_WAIT:g} s (a batch fills briefly), got {wait:g}"
        )
    if wait and limited:
        raise ConfigurationError(
            f"max_wait cannot be combined with concurrency=, rate=, key_concurrency= or key_rate= "
            f"(the handler of {event_type!r}): "
            "a limited type is claimed by statements of its own"
        )
    return wait


def _check_pack(
    event_type: str,
    pack: int | None,
    *,
    batch: int | None,
    concurrency: int | None,
    key_concurrency: int | None,
) -> None:
    """``pack`` checked (invariant 30): an int from 1 to :data:`MAX_PACK`, for a one-message
    handler whose slots are not bounded (a pack holds its rows' slots while it runs them in turn).
    """
    if pack is None:
        return
    if isinstance(pack, bool) or not isinstance(pack, int) or not 1 <= pack <= MAX_PACK:
        raise ConfigurationError(f"pack must be an int from 1 to {MAX_PACK}, not {pack!r}")
    if batch is not None:
        raise ConfigurationError(
            f"the handler of {event_type!r} cannot be both batch= and pack=: a batch handler's "
            "rows travel in batches already"
        )
    if concurrency is not None or key_concurrency is not None:
        raise ConfigurationError(
            f"pack= cannot be combined with concurrency= or key_concurrency= (the handler of "
            f"{event_type!r}): a pack holds every slot of its rows while it runs them one by one"
        )


def subscription_route(event_type: str, name: str | None) -> str:
    """The route of ``event_type``'s subscription ``name`` (``order.paid@receipt``; the event
    type itself without a name), both checked: neither may contain ``@`` (DESIGN invariant 28).

    :raises ConfigurationError: a bad event type or name.
    """
    if ROUTE_SEPARATOR in event_type:
        raise ConfigurationError(
            f"event_type {event_type!r} contains {ROUTE_SEPARATOR!r}, which separates an event type "
            "from a subscription's name: give the subscription's name as name="
        )
    if name is not None and (
        not isinstance(name, str) or not name.strip() or ROUTE_SEPARATOR in name or len(name) > 200
    ):
        raise ConfigurationError(
            f"a subscription's name must be a non-empty string of at most 200 characters "
            f"without {ROUTE_SEPARATOR!r}, not {name!r}"
        )
    return route(event_type, name)


def _refuse_mixing(handlers: dict[str, HandlerSpec], event_type: str, name: str | None) -> None:
    """An event type has one handler without a name or named subscriptions, never both: the
    producers fan out to the subscriptions alone, so the unnamed one would receive nothing."""
    for other in handlers:
        other_type, other_name = split_route(other)
        if other_type == event_type and (other_name is None) != (name is None):
            raise ConfigurationError(
                f"{event_type!r} has a handler without a name and named subscriptions: once an "
                "event type has a subscription, every handler of it needs a name= (the events "
                "go to its subscriptions only)"
            )
