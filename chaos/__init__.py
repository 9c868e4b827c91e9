"""The project's own chaos suite: ``python -m chaos [--short]`` (``make chaos``).

Real ``celery beat`` and ``celery worker`` processes deliver a mixed workload from a real
PostgreSQL outbox through a Redis server the suite owns, while it kills, restarts, flushes,
skews and re-routes what they depend on; at the end it checks the table against what the
handlers saw. docs/chaos.md describes each fault and how to read the summary.
"""
