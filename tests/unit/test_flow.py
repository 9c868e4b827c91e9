"""Flow control's pure parts: rate strings, declared limits, a claim's allowance."""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any

import pytest

from outbox_celery import ConfigurationError, RateLimited, RetryableError
from outbox_celery.errors import MAX_DELAY_SECONDS, RATE_LIMITED_DEFAULT
from outbox_celery.flow import (
    CAP_RECHECK,
    LIMIT_RECHECK,
    MAX_CONCURRENCY,
    MAX_RATE,
    Limit,
    allowance,
    parse_rate,
)
from outbox_celery.message import Outcome
from outbox_celery.worker.verdict import classify


@pytest.mark.parametrize(
    ("rate", "per_second"),
    [
        ("50/s", 50.0),
        ("3000/m", 50.0),
        ("10/h", 10 / 3600),
        ("7", 7.0),
        (2.5, 2.5),
        (100, 100.0),
        ("1.5/s", 1.5),
    ],
)
def test_rates_in_celerys_forms(rate: str | float, per_second: float) -> None:
    assert parse_rate(rate) == pytest.approx(per_second)


BAD_RATES = ["", "50/d", "fast", "-1/s", "0/s", 0, -3, True, "50 per s", float("nan"), None]


@pytest.mark.parametrize("rate", BAD_RATES)
def test_bad_rates_are_a_clear_value_error(rate: object) -> None:
    with pytest.raises(ValueError, match="rate"):
        parse_rate(rate)  # type: ignore[arg-type]


@pytest.mark.parametrize("concurrency", [0, -1, 1.5, True, "2"])
def test_bad_concurrency_is_refused(concurrency: object) -> None:
    with pytest.raises(ConfigurationError, match="concurrency"):
        Limit.declared(concurrency=concurrency, rate=None)  # type: ignore[arg-type]


def test_no_limit_declared_is_none() -> None:
    assert Limit.declared(concurrency=None, rate=None) is None
    assert Limit.declared(concurrency=3, rate="3000/m") == Limit(concurrency=3, rate=50.0)


@pytest.mark.parametrize("key_concurrency", [0, -1, 1.5, True, "2"])
def test_bad_key_concurrency_is_refused(key_concurrency: object) -> None:
    with pytest.raises(ConfigurationError, match="key_concurrency"):
        Limit.declared(concurrency=None, rate=None, key_concurrency=key_concurrency)  # type: ignore[arg-type]


def test_a_limit_per_key_alone_is_a_keyed_limit_whose_type_is_unbounded() -> None:
    limit = Limit.declared(concurrency=None, rate=None, key_concurrency=2)
    assert limit == Limit(key_concurrency=2) and limit.keyed
    assert not Limit(concurrency=2).keyed
    # The type itself is not bounded: the claim's batch is.
    a = allowance(limit, live=0, tokens=None, since_refill=None)
    assert a.rows > 1_000_000 and a.wait(limit, 200) is None


def test_a_rate_per_key_is_a_keyed_limit_with_a_bucket_per_key() -> None:
    limit = Limit.declared(concurrency=None, rate=None, key_rate="600/m")
    assert limit == Limit(key_rate=10.0) and limit.keyed and limit.key_burst == 2.0
    assert Limit(key_concurrency=1).key_burst == 0.0
    with pytest.raises(ValueError, match="rate"):
        Limit.declared(concurrency=None, rate=None, key_rate="0/s")


def test_concurrency_allowance_is_what_the_live_deliveries_leave() -> None:
    limit = Limit(concurrency=5)
    assert allowance(limit, live=3, tokens=None, since_refill=None).rows == 2
    assert allowance(limit, live=7, tokens=None, since_refill=None).rows == 0
    a = allowance(limit, live=3, tokens=None, since_refill=None)
    assert a.wait(limit, 2) == CAP_RECHECK  # took all it could: a finish wakes the claim, else 1 s
    assert a.wait(limit, 1) is None  # took less: nothing more was claimable


def test_rate_allowance_is_a_token_bucket_of_one_fifth_of_a_second() -> None:
    limit = Limit(rate=50.0)
    assert limit.burst == 10
    assert Limit(rate=1 / 3600).burst == 1  # at least one start
    assert allowance(limit, live=0, tokens=None, since_refill=None).rows == 10  # a full bucket
    assert allowance(limit, live=0, tokens=0.5, since_refill=0.05).rows == 3  # 0.5 + 2.5
    assert allowance(limit, live=0, tokens=0.0, since_refill=100.0).rows == 10  # capped
    assert allowance(limit, live=0, tokens=2.0, since_refill=-1.0).rows == 2  # clock never goes back
    both = allowance(Limit(concurrency=2, rate=50.0), live=0, tokens=None, since_refill=None)
    assert both.rows == 2 and not both.by_rate
    slow = Limit(rate=1.0)
    a = allowance(slow, live=0, tokens=0.2, since_refill=0.0)
    assert a.rows == 0 and a.wait(slow, 0) == pytest.approx(0.8)  # until the next token
    fast = allowance(limit, live=0, tokens=0.2, since_refill=0.0)
    assert fast.wait(limit, 0) == LIMIT_RECHECK  # never polled faster than this


def test_rate_limited_is_a_retryable_error_whose_attempt_does_not_count() -> None:
    exc = RateLimited(retry_after=timedelta(seconds=30), reason="HTTP 429")
    assert isinstance(exc, RetryableError)
    assert exc.retry_after == 30.0 and exc.delay == 30.0
    verdict = classify(exc, 1, lambda attempt, error: 1.0)
    assert verdict is not None and verdict.outcome is Outcome.RATE_LIMITED and verdict.delay == 30.0


@pytest.mark.parametrize(
    ("retry_after", "held"),
    [
        (-1, 0.0),
        (float("-inf"), 0.0),
        (float("nan"), RATE_LIMITED_DEFAULT),
        ("30", RATE_LIMITED_DEFAULT),
        (None, RATE_LIMITED_DEFAULT),
        (200 * 365 * 86400.0, MAX_DELAY_SECONDS),
        (float("inf"), MAX_DELAY_SECONDS),
        (timedelta(days=365 * 1000), MAX_DELAY_SECONDS),
    ],
)
def test_invariant_25_a_rate_limited_with_any_retry_after_stays_a_429(retry_after: Any, held: float) -> None:
    # A downstream's Retry-After never turns the 429 into an unclassified crash (which would
    # spend an attempt): clamped to 0 .. 100 years, what is not a number holds 60 s.
    exc = RateLimited(retry_after=retry_after, reason="HTTP 429")
    assert exc.retry_after == held and exc.delay == held
    verdict = classify(exc, 1, lambda attempt, error: 1.0)
    assert verdict is not None and verdict.outcome is Outcome.RATE_LIMITED and verdict.delay == held


@pytest.mark.parametrize(
    "declared",
    [
        {"key_concurrency": sys.maxsize},
        {"concurrency": 2**31},
        {"concurrency": MAX_CONCURRENCY + 1},
        {"key_concurrency": 0},
        {"rate": 1e300},
        {"key_rate": "1e12/s"},
        {"key_rate": 1e-9},
        {"rate": "1/h", "key_rate": float("inf")},
    ],
)
def test_invariant_25_every_limit_is_bounded_where_it_is_declared(declared: dict[str, Any]) -> None:
    # sys.maxsize as key_concurrency was accepted and failed every claim of every type with
    # "integer out of range": refused where the handler is registered, and by Limit itself.
    with pytest.raises(ConfigurationError):
        Limit.declared(**{"concurrency": None, "rate": None, **declared})
    with pytest.raises(ConfigurationError):
        Limit(**declared)
    assert Limit.declared(concurrency=MAX_CONCURRENCY, rate=MAX_RATE, key_concurrency=1, key_rate="1/h")
