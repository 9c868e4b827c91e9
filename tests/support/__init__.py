"""Reusable helpers for tests that run real Celery workers and beat against a real outbox.

* :mod:`support.apps`: the test Celery app (built from an :class:`~support.apps.AppSpec`), its
  scripted handler and the tables where handlers record what they saw.
* :mod:`support.worker_app`: the module ``celery -A`` loads; it builds the app from the
  environment.
* :mod:`support.processes`: start ``celery worker`` / ``celery beat`` subprocesses in their own
  process groups, wait for them, pause, kill and always reap them.
* :mod:`support.brokers`: read raw task messages off a queue and delete test queues.
* :mod:`support.db`: read rows and handler calls, and poll until a condition holds.
"""
