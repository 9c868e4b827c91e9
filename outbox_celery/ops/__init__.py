"""What operators run against an outbox table: every function takes a psycopg connection and a
table name (``"outbox"``, ``"schema.name"`` or a :class:`~outbox_celery.config.TableName`).

One module per thing an operator does, all re-exported here (``outbox_celery.ops.stats(...)``):

* :mod:`~outbox_celery.ops.snapshot`: the stats snapshot and the unclaimed messages;
* :mod:`~outbox_celery.ops.dead`: dead letters (list, show, requeue, skip);
* :mod:`~outbox_celery.ops.flow`: pause and resume event types and limit keys;
* :mod:`~outbox_celery.ops.retention`: purge done rows, and what holds the xmin horizon;
* :mod:`~outbox_celery.ops.heads`: ordering keys given their head back;
* :mod:`~outbox_celery.ops.groups`: groups finished or cancelled by hand;
* :mod:`~outbox_celery.ops.durations`: ``7d`` in, ``3d 4h`` out.

Besides them: :mod:`~outbox_celery.ops.subscriptions`, :mod:`~outbox_celery.ops.console` (the web
console's reads), :mod:`~outbox_celery.ops.health` (``outbox-celery health``) and
:mod:`~outbox_celery.ops.metrics` (the Prometheus collector). None of them needs Celery.

Writes refuse ambiguous or wrong input with :class:`AdminError` before anything changes.
Batched writes (:func:`purge_done`, :func:`requeue_all`) run each batch in its own short
transaction, so they need a connection that is not inside a transaction already.
"""

from __future__ import annotations

from ..errors import AdminError
from .dead import (
    MAX_REASON_LENGTH,
    SKIPPED_BY_OPERATOR,
    DeadFilters,
    DeadMessage,
    FailedAttempt,
    count_dead,
    failed_attempts,
    get_message,
    list_dead,
    requeue,
    requeue_all,
    skip,
    was_skipped,
)
from .durations import format_duration, parse_duration
from .flow import (
    FlowState,
    KeyFlowState,
    flow_states,
    flow_targets,
    key_states,
    pause,
    prune_flow_keys,
    resume,
)
from .groups import (
    DeadMember,
    GroupInfo,
    GroupSummary,
    cancel_group,
    finish_group,
    get_group,
    group_outcomes,
    group_summary,
    list_groups,
    purge_groups,
)
from .heads import repair_heads
from .horizon import Horizon, horizon
from .retention import count_purgeable, purge_done
from .snapshot import DEFAULT_STATS_CAP, AttemptsBucket, EventTypeStats, Stats, Unclaimed, stats, unclaimed

__all__ = [
    "DEFAULT_STATS_CAP",
    "MAX_REASON_LENGTH",
    "SKIPPED_BY_OPERATOR",
    "AdminError",
    "AttemptsBucket",
    "DeadFilters",
    "DeadMember",
    "DeadMessage",
    "EventTypeStats",
    "FailedAttempt",
    "FlowState",
    "GroupInfo",
    "GroupSummary",
    "Horizon",
    "KeyFlowState",
    "Stats",
    "Unclaimed",
    "cancel_group",
    "count_dead",
    "count_purgeable",
    "failed_attempts",
    "finish_group",
    "flow_states",
    "flow_targets",
    "format_duration",
    "get_group",
    "get_message",
    "group_outcomes",
    "group_summary",
    "horizon",
    "key_states",
    "list_dead",
    "list_groups",
    "parse_duration",
    "pause",
    "prune_flow_keys",
    "purge_done",
    "purge_groups",
    "repair_heads",
    "requeue",
    "requeue_all",
    "resume",
    "skip",
    "stats",
    "unclaimed",
    "was_skipped",
]
