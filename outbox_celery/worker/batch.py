"""A batch handler's run (DESIGN invariant 21): the handler once for its started messages, then
every outcome in one fenced statement."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from ..backoff import RetryPolicy
from ..config import OutboxConfig
from ..db.completer import Lease
from ..handlers import HandlerSpec
from ..message import Message, Outcome
from .fence import FencedWrites
from .heartbeat import lease_heartbeat
from .verdict import Verdict, classify, error_text, ms_since, outcome_of

__all__ = ["BatchRun"]

logger = logging.getLogger(__name__)


def _batch_failures(result: object, ids: set[int]) -> Mapping[int, BaseException]:
    """A batch handler's return value checked: ``{id: exception}`` of the messages not delivered.

    :raises TypeError: anything but ``None`` or a mapping from this batch's ids to exception
        instances (the whole batch is then treated as an unclassified failure).
    """
    if result is None:
        return {}
    if not isinstance(result, Mapping):
        raise TypeError(
            f"a batch handler returns None or a mapping id -> outcome, not {type(result).__name__}"
        )
    for key, value in result.items():
        if key not in ids:
            raise TypeError(f"a batch handler returned an outcome for id {key!r}, which is not in its batch")
        if not isinstance(value, BaseException):
            raise TypeError(
                f"a batch handler's outcome for id {key} must be an exception instance "
                f"(RetryableError, Defer, PermanentError), not {type(value).__name__}"
            )
    return result


class BatchRun:
    """Runs batch handlers of one worker process.

    :param retry: the wait after a retryable failure that carries no delay of its own.
    """

    def __init__(self, config: OutboxConfig, fence: FencedWrites, retry: Callable[[], RetryPolicy]) -> None:
        self.config = config
        self.fence = fence
        self._retry = retry

    def __call__(self, spec: HandlerSpec, msgs: list[Message], log: dict[str, Any]) -> dict[int, Outcome]:
        """Call a batch handler on started messages, then write every outcome (one statement).

        The handler receives the messages sorted by id and returns ``None`` (all delivered) or a
        mapping from message id to the outcome of those that were not; an exception it raises
        applies to every message. An unclassified exception is recorded for every row and
        re-raised (the rows come back through their lease).
        """
        leases = [Lease(m.id, m.lease_version) for m in msgs]
        msgs = [replace(m, _extend=self.fence.extender(x)) for m, x in zip(msgs, leases, strict=True)]
        log = {**log, "event_type": spec.event_type, "batch": len(msgs)}
        started = time.monotonic()
        retry = self._retry()
        try:
            with lease_heartbeat(self.config, lambda seconds: self.fence.extend(leases, seconds), log=log):
                result = spec.fn(list(msgs))
            failures = _batch_failures(result, {m.id for m in msgs})
        except BaseException as exc:
            verdicts = {m.id: classify(exc, m.attempts, retry) for m in msgs}
            if any(v is None for v in verdicts.values()):
                # Not classified: recorded for every row, which comes back through its lease.
                error = error_text(exc)
                self._finish(msgs, dict.fromkeys(verdicts, Verdict(Outcome.ERROR, error=error)))
                logger.error(
                    "outbox batch of %s %s raised %s; rows return after their lease",
                    len(msgs),
                    spec.event_type,
                    type(exc).__name__,
                    extra={**log, "outcome": Outcome.ERROR, "duration_ms": ms_since(started)},
                )
                raise
            whole = {i: v for i, v in verdicts.items() if v is not None}
        else:
            whole = {}
            for m in msgs:
                failed = failures.get(m.id)
                if failed is None:
                    whole[m.id] = Verdict(Outcome.DONE)
                else:
                    # A non-outcome exception for one message: recorded, back through its lease.
                    whole[m.id] = classify(failed, m.attempts, retry) or Verdict(
                        Outcome.ERROR, error=error_text(failed)
                    )
        outcomes = self._finish(msgs, whole)
        tally = Counter(outcomes.values())
        logger.info(
            "outbox batch of %s %s -> %s",
            len(msgs),
            spec.event_type,
            ", ".join(f"{k}={n}" for k, n in sorted(tally.items())),
            extra={
                **log,
                "outcome": "batch",
                **{str(k): n for k, n in tally.items()},
                "duration_ms": ms_since(started),
            },
        )
        return outcomes

    def _finish(self, msgs: list[Message], verdicts: Mapping[int, Verdict]) -> dict[int, Outcome]:
        """Write a batch's verdicts: the completer's one fenced statement for them all (an
        ordered done under its key lock, a RateLimited item's hold, in the same transaction)."""
        finishes = [verdicts[m.id].finish(m) for m in msgs]
        # Wake the claim: a batch's leases ended at once, room under the bound.
        won = self.fence.finish(finishes, notify=self.config.listen)
        return {m.id: outcome_of(verdicts[m.id], won.of(m.id)) for m in msgs}
