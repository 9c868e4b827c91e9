"""The demo engine behind ``make demo`` (``python -m examples.demo``).

It runs the orders example as a real stack: PostgreSQL and Redis (embedded unless
``OUTBOX_DSN`` / ``CELERY_BROKER_URL`` point elsewhere), the schema migration, Celery workers per
queue, beat, Flower, the webhook receiver and the orders API as subprocesses. It pushes orders
through the API, shows progress read from PostgreSQL, prints a summary read from PostgreSQL, and
stops everything it started.
"""
