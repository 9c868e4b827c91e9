"""POST an outbox message to a webhook and translate the answer into an outbox outcome.

Standard library only (``urllib.request``). The mapping is what most webhook consumers expect:

=====================================  ==============================================
what happened                          outcome
=====================================  ==============================================
2xx                                    delivered (the handler returns)
429 Too Many Requests                  ``RateLimited(Retry-After)``: the whole event
                                       type waits, on every worker, no attempt spent
408, 5xx                               ``RetryableError`` (the outbox's backoff)
connection refused/reset, timeout      ``RetryableError`` (the request may or may not
                                       have had its effect: the receiver de-duplicates)
any other 4xx                          ``PermanentError`` (dead letter, for a human)
=====================================  ==============================================
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from datetime import UTC, datetime
from email.message import Message as Headers
from email.utils import parsedate_to_datetime

from outbox_celery import Message, PermanentError, RateLimited, RetryableError

from . import settings

__all__ = ["post_event", "retry_after"]

TIMEOUT = 10.0
"""Seconds to wait for the receiver (well below the delivery task's time limit)."""
DEFAULT_RETRY_AFTER = 1.0
"""Seconds to hold back after a 429 that names no ``Retry-After``."""
MAX_RETRY_AFTER = 3600.0
"""A receiver asking for more than this is capped (the outbox's own backoff cap applies too)."""


def retry_after(headers: Headers | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date); ``None`` if absent."""
    value = headers.get("Retry-After") if headers is not None else None
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - datetime.now(UTC)).total_seconds()
    if seconds != seconds:  # NaN
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER)


def post_event(message: Message, *, url: str | None = None, timeout: float = TIMEOUT) -> None:
    """POST ``message`` as JSON with its ``Idempotency-Key``; raise what the outbox should do."""
    body = json.dumps(
        {
            "id": message.id,
            "event_type": message.event_type,
            "order_id": int(message.aggregate_id),
            "attempt": message.attempts,
            "created_at": message.created_at.isoformat(),
            "data": message.payload,
        }
    ).encode()
    request = urllib.request.Request(
        url or settings.webhook_url(),
        data=body,
        method="POST",
        headers={
            "Content-Type": "application/json",
            "Idempotency-Key": message.idempotency_key,
            "X-Event-Type": message.event_type,
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
    except urllib.error.HTTPError as exc:  # before URLError: it is one
        detail = exc.read(300).decode("utf-8", "replace").strip()
        text = f"webhook answered HTTP {exc.code} {exc.reason}: {detail}".strip()
        if exc.code == 429:
            # The receiver is over its rate, not failing this message: hold back every message
            # of the type until Retry-After, instead of each one finding out by its own 429.
            wait = retry_after(exc.headers)
            raise RateLimited(DEFAULT_RETRY_AFTER if wait is None else wait, text) from None
        if exc.code == 408 or exc.code >= 500:
            raise RetryableError(text) from None
        raise PermanentError(text) from None
    except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
        # Refused, reset, dropped without an answer, timed out: maybe delivered, maybe not.
        # Retrying is safe because the receiver de-duplicates on the Idempotency-Key.
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        raise RetryableError(f"webhook unreachable: {type(exc).__name__}: {reason}") from None
