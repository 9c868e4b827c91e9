"""The real-worker flow benchmark's arithmetic (benchmarks/flow_celery.py): overlaps and windows."""

from __future__ import annotations

from benchmarks.flow_celery import max_overlap, most_in_window, parser


def test_max_overlap_counts_spans_open_at_once_and_an_end_closes_before_a_start() -> None:
    assert max_overlap([]) == 0
    assert max_overlap([(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]) == 1
    assert max_overlap([(0.0, 1.0), (0.5, 1.5), (0.6, 0.7), (1.2, 2.0)]) == 3


def test_most_in_window_sliding_is_at_least_aligned() -> None:
    # Aligned on the first start: [0, 1) holds 2, [1, 2) holds 3; sliding, [0.9, 1.9) holds 4.
    sliding, aligned = most_in_window([0.0, 0.9, 1.0, 1.1, 1.5, 2.5])
    assert (sliding, aligned) == (4, 3)
    assert most_in_window([]) == (0, 0)


def test_the_defaults_are_the_issues_setup_with_a_20_s_rate_window() -> None:
    a = parser().parse_args([])
    assert (a.workers, a.processes, a.messages, a.concurrency, a.sleep) == (3, 4, 2000, 5, 0.05)
    assert (a.rate, a.rate_seconds) == ("50/s", 20.0)
