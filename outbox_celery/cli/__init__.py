"""The ``outbox-celery`` command line: see, steer and maintain an outbox without writing SQL.

::

    outbox-celery [--dsn DSN] [--table NAME] [-A module:outbox] COMMAND [--dsn DSN] [--table NAME] ...

    migrate [--check]                    schema up to date (--check: exit 1 when behind)
    stats [--unclaimed-after D] [--exact] [--json] depth, ages, leases, attempts, event types, what waits
    dead list [filters] [--json]         dead messages, paged by id
    dead show ID [--json]                one message (any status) and why it waits
    dead requeue ID... | --all           back to pending now, attempts reset
    dead skip ID... --reason TEXT        done on purpose (unblocks an ordered key)
    purge --older-than 7d [--dry-run]    delete old done rows in short batches
    pause EVENT_TYPE / resume EVENT_TYPE claimed by nobody until resumed (flow control)
    metrics [--port 9808]                Prometheus exporter

Also ``python -m outbox_celery`` and, inside Celery's own CLI, ``celery -A proj outbox ...``.
The database comes from ``--dsn`` or ``OUTBOX_DSN``, else from the loaded Outbox; the table from
``--table`` or ``OUTBOX_TABLE``, else the Outbox's, else ``outbox``. Passwords are never printed.
User errors print one line and exit 1.

One module per command group defines its commands on :data:`cli` (:mod:`.main`): importing
them here registers every command, in both entry points.
"""

from __future__ import annotations

# The command modules, imported for the commands they register on ``cli``.
from . import dead, flow, groups, monitoring, retention, schema, stats, subscriptions, web  # noqa: F401
from .main import celery_outbox, cli, main

__all__ = ["celery_outbox", "cli", "main"]
