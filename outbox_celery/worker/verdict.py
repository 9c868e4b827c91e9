"""A handler run's verdict: what its outcome writes, before the fenced finalize decides whether it won.

:func:`classify` turns a handler's exception into a :class:`Verdict`; :meth:`Verdict.finish` makes
the completer's :class:`~outbox_celery.db.completer.Finish` of it (invariants 6, 7, 8, 23). Shared by
the one-message and the batch delivery.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass

from ..backoff import RetryPolicy
from ..db.completer import Finalized, Finish, Lease
from ..errors import Defer, PermanentError, RateLimited, RetryableError
from ..message import Message, Status
from ..outcomes import Outcome, step_of

__all__ = ["Verdict", "classify", "error_text", "ms_since", "outcome_of"]


def ms_since(started: float) -> float:
    """Milliseconds since ``started`` (monotonic), for the logs."""
    return round((time.monotonic() - started) * 1000, 1)


def error_text(exc: BaseException, limit: int = 4000) -> str:
    """``last_error`` of an exception: its type and text, with the traceback of an unclassified one."""
    text = f"{type(exc).__name__}: {exc}"
    if not isinstance(exc, RetryableError | PermanentError | Defer):  # RateLimited is retryable
        tb = "".join(traceback.format_exception(exc)).strip()
        text = f"{text}\n{tb}"
    return text[:limit]


@dataclass(frozen=True, slots=True)
class Verdict:
    """How a handler run ended, before the fenced finalize: what to write, not whether it won."""

    outcome: Outcome
    delay: float = 0.0
    error: str = ""

    def finish(self, msg: Message, lease_version: int | None = None) -> Finish:
        """The completer's finish of this verdict for ``msg`` (under ``lease_version``, default
        the message's own)."""
        version = msg.lease_version if lease_version is None else lease_version
        return Finish(
            Lease(msg.id, version),
            step_of(self.outcome),
            self.delay,
            self.error,
            ordered=msg.ordering_key is not None,
            grouped=msg.group_id is not None,
        )


def outcome_of(verdict: Verdict, result: Finalized) -> Outcome:
    """What the fenced write of a verdict came to: the verdict's outcome when it applied,
    ``dead`` when a retry or defer went past its limit, ``lost_lease`` when another claim won."""
    if not result.applied:
        return Outcome.LOST_LEASE
    return Outcome.DEAD if result.status is Status.DEAD else verdict.outcome


def classify(exc: BaseException, attempts: int, retry: RetryPolicy) -> Verdict | None:
    """The verdict for a handler's exception; ``None`` when the handler did not classify it."""
    if isinstance(exc, Defer):
        return Verdict(Outcome.DEFER, delay=exc.delay, error=exc.reason)
    if isinstance(exc, RateLimited):
        # Before RetryableError, its base: no attempt spent, the whole event type held.
        return Verdict(Outcome.RATE_LIMITED, delay=exc.retry_after, error=exc.reason)
    if isinstance(exc, RetryableError):
        delay = exc.delay if exc.delay is not None else retry(attempts, exc)
        return Verdict(Outcome.RETRY, delay=delay, error=error_text(exc))
    if isinstance(exc, PermanentError):
        return Verdict(Outcome.DEAD, error=error_text(exc))
    return None
