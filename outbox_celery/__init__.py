"""outbox-celery: a transactional outbox for PostgreSQL and Celery.

Write events in your business transaction with :func:`enqueue`; an :class:`Outbox` bound to
your Celery app claims them with leases, delivers each through one Celery task and finalizes
it with a fenced update, at least once.
"""

from __future__ import annotations

from . import _moved
from .app.outbox import Outbox
from .backoff import Backoff
from .claim.executor import Claimed
from .config import OutboxConfig
from .databases import Database
from .db.migrations import migrate
from .db.store import Store
from .errors import (
    ConfigurationError,
    Defer,
    OutboxError,
    PermanentError,
    ProducerError,
    RateLimited,
    RetryableError,
    UnknownDatabase,
)
from .message import Message, Outcome, Status
from .produce.enqueue import (
    Event,
    Group,
    enqueue,
    enqueue_async,
    enqueue_group,
    enqueue_group_async,
    enqueue_many,
    enqueue_many_async,
    group,
)
from .table import TableName

__all__ = [
    "Backoff",
    "Claimed",
    "ConfigurationError",
    "Database",
    "Defer",
    "Event",
    "Group",
    "Message",
    "Outbox",
    "OutboxConfig",
    "OutboxError",
    "Outcome",
    "PermanentError",
    "ProducerError",
    "RateLimited",
    "RetryableError",
    "Status",
    "Store",
    "TableName",
    "UnknownDatabase",
    "enqueue",
    "enqueue_async",
    "enqueue_group",
    "enqueue_group_async",
    "enqueue_many",
    "enqueue_many_async",
    "group",
    "migrate",
]

__version__ = "0.1.0"

# The import paths of modules that moved into folders keep working, with a warning (_moved.py).
_moved.install()
