"""How a handler's exception becomes a verdict, before any fenced write (invariants 6, 7, 8)."""

from __future__ import annotations

import pytest

from outbox_celery.errors import Defer, PermanentError, RetryableError
from outbox_celery.message import Outcome
from outbox_celery.worker.verdict import Verdict, classify


class Policy:
    """A retry policy that records what it was asked."""

    def __init__(self, delay: float = 7.0) -> None:
        self.delay = delay
        self.asked: list[tuple[int, BaseException]] = []

    def __call__(self, attempts: int, exc: BaseException) -> float:
        self.asked.append((attempts, exc))
        return self.delay


def test_a_retryable_error_without_a_delay_asks_the_policy_with_the_attempt_made() -> None:
    policy = Policy(7.0)
    exc = RetryableError("HTTP 503")
    verdict = classify(exc, 3, policy)
    assert verdict == Verdict(Outcome.RETRY, delay=7.0, error="RetryableError: HTTP 503")
    assert policy.asked == [(3, exc)]


def test_a_retryable_error_with_a_delay_overrides_the_policy() -> None:
    policy = Policy()
    verdict = classify(RetryableError("HTTP 429", delay=30), 1, policy)
    assert verdict is not None and (verdict.outcome, verdict.delay) == (Outcome.RETRY, 30.0)
    assert policy.asked == []


def test_defer_waits_its_delay_and_records_its_reason() -> None:
    policy = Policy()
    verdict = classify(Defer(12.5, reason="customer not yet created"), 4, policy)
    assert verdict == Verdict(Outcome.DEFER, delay=12.5, error="customer not yet created")
    assert policy.asked == []


def test_a_permanent_error_is_dead_with_its_message_and_no_traceback() -> None:
    try:
        raise PermanentError("HTTP 400: bad address")
    except PermanentError as exc:
        verdict = classify(exc, 1, Policy())
    assert verdict == Verdict(Outcome.DEAD, error="PermanentError: HTTP 400: bad address")


def test_a_long_message_is_cut_to_what_last_error_keeps() -> None:
    verdict = classify(PermanentError("x" * 10_000), 1, Policy())
    assert verdict is not None and len(verdict.error) == 4000


@pytest.mark.parametrize("exc", [ValueError("boom"), KeyError("k"), RuntimeError(), Exception("plain")])
def test_an_exception_the_handler_did_not_classify_has_no_verdict(exc: BaseException) -> None:
    policy = Policy()
    assert classify(exc, 1, policy) is None
    assert policy.asked == []
