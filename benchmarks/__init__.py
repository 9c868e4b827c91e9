"""Benchmarks of outbox-celery: ``python -m benchmarks`` (``make bench``); see docs/performance.md."""
