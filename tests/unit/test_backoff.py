"""Full-jitter backoff (DESIGN invariant 6): the window, its bounds and its validation."""

from __future__ import annotations

import math
import random

import pytest

from outbox_celery import Backoff


@pytest.mark.parametrize(("base", "cap"), [(1.0, 300.0), (0.5, 10.0), (2.0, 2.0), (0.001, 1e9)])
def test_window_is_min_of_cap_and_base_times_two_to_the_attempt(base: float, cap: float) -> None:
    policy = Backoff(base=base, cap=cap)
    for attempt in range(40):
        assert policy.window(attempt) == pytest.approx(min(cap, base * 2**attempt))


def test_window_after_first_attempt_is_twice_the_base() -> None:
    assert Backoff(base=1.5, cap=100).window(1) == 3.0


def test_window_never_exceeds_cap_even_for_huge_attempt_counts() -> None:
    policy = Backoff(base=1.0, cap=300.0)
    for attempt in (9, 63, 64, 65, 1000, 10**6):
        assert policy.window(attempt) == 300.0


def test_defaults_are_one_second_base_and_five_minute_cap() -> None:
    assert Backoff() == Backoff(base=1.0, cap=300.0)


@pytest.mark.parametrize("attempt", [0, 1, 3, 8, 12, 100])
def test_delay_is_drawn_from_the_whole_jitter_window(attempt: int) -> None:
    policy = Backoff(base=1.0, cap=60.0)
    rng = random.Random(attempt)
    window = policy.window(attempt)
    draws = [policy.delay(attempt, rng) for _ in range(2000)]
    assert all(0.0 <= d <= window for d in draws)
    # Full jitter, not "equal jitter": the draws spread over the whole window, down to ~0.
    assert min(draws) < 0.05 * window
    assert max(draws) > 0.95 * window
    assert 0.4 * window < sum(draws) / len(draws) < 0.6 * window


def test_delay_is_reproducible_with_a_seeded_rng() -> None:
    policy = Backoff(base=1.0, cap=60.0)
    first = [policy.delay(n, random.Random(7)) for n in range(10)]
    second = [policy.delay(n, random.Random(7)) for n in range(10)]
    assert first == second


def test_delay_without_rng_uses_module_random_and_stays_in_bounds() -> None:
    policy = Backoff(base=0.25, cap=4.0)
    for attempt in range(10):
        assert 0.0 <= policy.delay(attempt) <= policy.window(attempt)


@pytest.mark.parametrize(
    ("base", "cap"),
    [(0.0, 10.0), (-1.0, 10.0), (math.nan, 10.0), (5.0, 4.0), (1.0, math.nan), (1.0, 0.5)],
)
def test_invalid_base_or_cap_is_refused(base: float, cap: float) -> None:
    with pytest.raises(ValueError, match="backoff"):
        Backoff(base=base, cap=cap)


def test_negative_attempt_is_refused() -> None:
    policy = Backoff()
    with pytest.raises(ValueError, match="attempt"):
        policy.window(-1)
    with pytest.raises(ValueError, match="attempt"):
        policy.delay(-1)


def test_backoff_is_immutable() -> None:
    policy = Backoff()
    with pytest.raises(AttributeError):
        policy.base = 2.0  # type: ignore[misc]
