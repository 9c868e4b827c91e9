"""Exceptions raised by outbox-celery and by the handlers it calls.

Handlers translate what their downstream said into one of three outcomes:

* :class:`RetryableError` -- try again later (full-jitter backoff, or the delay it carries,
  e.g. an HTTP 429 ``Retry-After``). The attempt counts.
* :class:`PermanentError` -- never going to work; the message goes ``dead`` for a human.
* :class:`Defer` -- not an error: "not yet" (a business precondition is missing). The message
  goes back to ``pending`` after ``delay`` and the attempt is refunded.
* :class:`RateLimited` -- the downstream said "too many" (an HTTP 429): this message and every
  message of its event type not started yet wait until ``retry_after``; no attempt is spent
  (docs/flow-control.md, DESIGN invariant 23).

Any other exception is recorded in ``last_error``, surfaces as a failed Celery task, and the
message comes back through its lease: it is not silently classified as transient.
"""

from __future__ import annotations

import math
from datetime import timedelta

__all__ = [
    "MAX_DELAY_SECONDS",
    "AdminError",
    "ConfigurationError",
    "Defer",
    "InboxError",
    "MigrationError",
    "OutboxError",
    "PayloadError",
    "PermanentError",
    "ProducerError",
    "RateLimited",
    "RetryableError",
    "UnknownDatabase",
    "first_line",
    "seconds",
]


# -- the checks every room makes of its inputs, and how it reports an error in one line ------

# make_interval() overflows silently on PostgreSQL 15 for absurd values; nothing real waits this long.
MAX_DELAY_SECONDS = 100 * 365 * 86400.0


def seconds(
    value: object,
    name: str,
    *,
    error: type[Exception] = ValueError,
    positive: bool = False,
    delay: bool = False,
) -> float:
    """``value`` (a number or a :class:`~datetime.timedelta`) as float seconds, or raise ``error``.

    Refuses booleans (``True`` is not one second), NaN, infinity and negatives; zero too when
    ``positive``; more than :data:`MAX_DELAY_SECONDS` for a ``delay`` (a row's due time).
    """
    if delay:
        wanted = "a number of seconds between 0 and 100 years"
    else:
        wanted = f"a {'positive' if positive else 'non-negative'} number of seconds"
    if isinstance(value, timedelta):
        result = value.total_seconds()
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise error(f"{name} must be {wanted} (a number or a timedelta), got {value!r}")
    else:
        result = float(value)
    too_large = delay and result > MAX_DELAY_SECONDS
    if not math.isfinite(result) or result < 0 or (positive and result == 0) or too_large:
        raise error(f"{name} must be {wanted}, got {value!r}")
    return result


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type's name if empty), for one-line reports."""
    text = str(exc).strip()
    return text.splitlines()[0].strip() if text else type(exc).__name__


class OutboxError(Exception):
    """Root of every exception defined by outbox-celery."""


class ConfigurationError(OutboxError, ValueError):
    """A setting has an invalid value or settings contradict each other."""


class UnknownDatabase(ConfigurationError):  # noqa: N818 - named after what it reports
    """A task or a command names a database its Outbox does not serve (``databases=``).

    A delivery task that raises it never started its row: once its lease ends, the next claim
    gives it back to pending with no attempt spent, as any claimed row whose task never started
    (claimable at once the first time, after a delay as it repeats: DESIGN invariants 16, 34).
    """


class AdminError(OutboxError, ValueError):
    """An operator command was refused; nothing was changed (``outbox_celery.ops``)."""


class InboxError(OutboxError):
    """An inbox maintenance call was used wrongly (``outbox_celery.inbox``)."""


class MigrationError(OutboxError):
    """The schema cannot be brought up to date safely (``outbox_celery.db.migrations``)."""


class ProducerError(OutboxError, ValueError):
    """An enqueue was refused; nothing was written."""


class PayloadError(OutboxError, ValueError):
    """A payload that cannot be written, or that would not come back as itself
    (:mod:`outbox_celery.codec`, DESIGN invariant 27). ``enqueue`` raises it as the cause of its
    :class:`ProducerError`."""


class RetryableError(OutboxError):
    """The delivery failed but may succeed later.

    :param message: what went wrong, stored in ``last_error``.
    :param delay: seconds (or a :class:`~datetime.timedelta`) to wait before the next attempt,
        overriding the backoff policy (for example an HTTP ``Retry-After``). ``None`` uses the
        outbox's full-jitter backoff.
    """

    def __init__(self, message: str = "retryable error", *, delay: float | timedelta | None = None):
        super().__init__(message)
        self.delay: float | None = None if delay is None else seconds(delay, "delay", delay=True)


class PermanentError(OutboxError):
    """The delivery can never succeed; the message goes ``dead`` with this error."""


class Defer(OutboxError):  # noqa: N818 - it is an outcome, not an error
    """Deliver later without spending an attempt (a business "not yet").

    :param delay: seconds (or a :class:`~datetime.timedelta`) before the message is claimable
        again.
    :param reason: stored in ``last_error`` so operators can see why it waits.
    """

    def __init__(self, delay: float | timedelta, reason: str = "deferred"):
        super().__init__(reason)
        self.delay: float = seconds(delay, "delay", delay=True)
        self.reason = reason


#: Seconds a :class:`RateLimited` holds when its ``retry_after`` is not a number of seconds.
RATE_LIMITED_DEFAULT = 60.0


def _retry_after(value: object) -> float:
    """A downstream's Retry-After as seconds from 0 to 100 years (:class:`RateLimited`)."""
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        return RATE_LIMITED_DEFAULT
    return min(max(float(value), 0.0), MAX_DELAY_SECONDS)


class RateLimited(RetryableError):  # noqa: N818 - it is an outcome, not an error
    """The downstream is rate limiting (an HTTP 429): hold back the whole event type.

    This message goes back to ``pending`` at ``now() + retry_after`` with its attempt refunded
    (as :class:`Defer`: being told "too many" says nothing about the message; it goes ``dead``
    only once held past ``max_defer_age`` since it was created), and no claim hands out another
    message of the same event type before then, on any worker: the type's flow row is held
    until that time (a later hold never shortens an earlier one). Deliveries already running
    finish. ``outbox-celery resume <event_type>`` ends the hold at once. Other event types flow
    on. A subclass of :class:`RetryableError`, so code that catches that still catches this.

    A message enqueued with a ``limit_key`` holds only its key (DESIGN invariant 24): the other
    keys of the event type flow on.

    :param retry_after: seconds (or a :class:`~datetime.timedelta`) to hold the event type,
        for example the response's ``Retry-After``. A downstream's number is taken as it comes,
        never refused (a 429 stays a 429, DESIGN invariant 25): a negative one counts as 0, one
        over 100 years as 100 years, and what is not a number of seconds at all (NaN, a string,
        ``None``) as :data:`RATE_LIMITED_DEFAULT` (60 s). The hold of the event type or key is
        at most ``max_defer_age`` whatever it says (docs/flow-control.md).
    :param reason: stored in ``last_error``.
    """

    def __init__(self, retry_after: float | timedelta, reason: str = "rate limited"):
        held = _retry_after(retry_after)
        super().__init__(reason, delay=held)
        self.retry_after: float = held
        self.reason = reason
