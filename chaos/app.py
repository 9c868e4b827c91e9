"""The Celery app the chaos run's ``celery worker`` and ``celery beat`` processes load.

``celery -A chaos.app worker|beat``, configured by the runner through ``CHAOS_*`` environment
variables. One Outbox serves two databases on the same server (``databases=``): ``one``
(``CHAOS_DSN``) and ``two`` (``CHAOS_DSN_TWO``), each with its own outbox table. One handler per
message kind; each appends what it saw (database, row id, lease version, attempt, outcome,
ordering key, pid, and the database its payload says it was written to) as one JSON line to
``CHAOS_SEEN``, which the end check compares with each database's table. A line is written with
one ``O_APPEND`` write, so lines from many processes never interleave and the file's order is
the order in which handlers ran.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import psycopg
from celery import Celery

from outbox_celery import Defer, Message, PermanentError, RetryableError
from outbox_celery.app.outbox import Outbox

from .workload import DSN_ENV, FANOUT, GROUP_FAN, LATE, PERMANENT_ERROR

__all__ = ["app", "outbox", "record"]

app = Celery("chaos", broker=os.environ.get("CHAOS_BROKER_URL", "memory://"))
app.conf.update(
    task_ignore_result=True,
    worker_send_task_events=False,
    broker_connection_retry_on_startup=True,
    # Keep reconnecting for as long as the broker is down (the broker restart fault).
    broker_connection_max_retries=None,
    worker_cancel_long_running_tasks_on_connection_loss=False,
    beat_schedule={},
)

outbox = Outbox(
    app,
    name="chaos",
    # None when not run by the runner (importing the module, `celery inspect`).
    databases={db: os.environ[env] for db, env in DSN_ENV.items() if os.environ.get(env)} or None,
    claim_queue="chaos.claim",
    default_queue="chaos.deliver",
    lease=float(os.environ.get("CHAOS_LEASE", "3")),
    claim_interval=float(os.environ.get("CHAOS_CLAIM_INTERVAL", "0.25")),
    batch_size=100,
    max_attempts=12,
    backoff_base=0.2,
    backoff_cap=2.0,
    unroutable_delay=2.0,
    pool_max_size=2,
    retention=None,
    # Settings a fault needs (the pgbouncer window's prepare_threshold), as JSON.
    **json.loads(os.environ.get("CHAOS_OUTBOX_SETTINGS") or "{}"),
)


def record(message: Message, outcome: str) -> None:
    """Append one line saying this handler run saw ``message`` and what it decided."""
    payload = message.payload if isinstance(message.payload, dict) else {}
    line = json.dumps(
        {
            # Row ids, ordering keys and effects are each database's own.
            "db": message.database,
            # Where the producer wrote the event: the end check wants it equal to "db".
            "w": payload.get("db"),
            "id": message.id,
            "v": message.lease_version,
            "a": message.attempts,
            "t": message.route,
            "o": outcome,
            # Each subscription orders its own messages of a key (DESIGN invariant 28).
            "k": (
                f"{message.ordering_key}@{message.route}"
                if message.subscription and message.ordering_key
                else message.ordering_key
            ),
            "pid": os.getpid(),
        },
        separators=(",", ":"),
    )
    fd = os.open(os.environ["CHAOS_SEEN"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


@outbox.handler("chaos.ok", pack=8)
def ok(message: Message) -> None:
    """Delivered at once; up to 8 to a task (a pack, DESIGN invariant 30), so kills catch packs."""
    record(message, "ok")


@outbox.handler("chaos.member")
def member(message: Message) -> None:
    """A group's member (DESIGN invariant 29): delivered at once."""
    record(message, "ok")


@outbox.handler("chaos.group_done")
def group_done(message: Message) -> None:
    """A group's callback: delivered at once; the end check wants one per group, each run."""
    record(message, "ok")


@outbox.handler("chaos.ordered")
def ordered(message: Message) -> None:
    """Delivered at once; the end check verifies that each key's messages ran in id order."""
    record(message, "ok")


@outbox.handler("chaos.retry")
def retry(message: Message) -> None:
    """Fails retryably until its attempt number passes ``payload["fail"]``."""
    if message.attempts <= int(message.payload["fail"]):
        record(message, "retry")
        raise RetryableError("chaos: try again", delay=0.3)
    record(message, "ok")


@outbox.handler("chaos.permanent")
def permanent(message: Message) -> None:
    """Never works: must end ``dead`` with :data:`PERMANENT_ERROR`."""
    record(message, "permanent")
    raise PermanentError(PERMANENT_ERROR)


@outbox.handler("chaos.defer")
def defer(message: Message) -> None:
    """Defers once (a marker file remembers it across processes), then is delivered.

    A deferral refunds the attempt, so ``attempts`` cannot tell the first run from the next.
    """
    marker = Path(os.environ["CHAOS_MARKERS"]) / f"{message.database}-{message.id}"
    if not marker.exists():
        marker.touch()
        record(message, "defer")
        raise Defer(float(message.payload["delay"]), "chaos: not yet")
    record(message, "ok")


@outbox.handler("chaos.tx", transactional=True, pack=4)
def tx(message: Message, conn: psycopg.Connection[object]) -> None:
    """Transactional: its effect row commits with its done, or not at all; up to 4 to a
    task (a pack, DESIGN invariant 30), each in its own transaction.

    It sleeps inside the transaction after writing the effect, so kills, backend kills and
    restarts often catch it between the effect and the commit; the end check wants exactly one
    effect per done message.
    """
    # conn is the transaction of the message's own database: so is the effect table.
    conn.execute(
        "INSERT INTO chaos_effects (outbox_id, lease_version) VALUES (%s, %s)",
        [message.id, message.lease_version],
    )
    time.sleep(float(message.payload["sleep"]))
    record(message, "ok")


@outbox.handler("chaos.batch", batch=20)
def batch(messages: list[Message]) -> dict[int, Exception] | None:
    """A batch handler: per item ok, or retryable on its first ``payload["fail"]`` runs.

    It sleeps once per batch (the longest of its items' ``sleep``) after recording, so kills
    often catch a batch between its handler and its finish: every row must come back.
    """
    failed: dict[int, Exception] = {}
    for message in messages:
        if message.attempts <= int(message.payload["fail"]):
            record(message, "retry")
            failed[message.id] = RetryableError("chaos: this item again", delay=0.3)
        else:
            record(message, "ok")
    time.sleep(max(float(m.payload["sleep"]) for m in messages))
    return failed or None


@outbox.handler("chaos.slow", concurrency=4, key_concurrency=2)
def slow(message: Message) -> None:
    """Takes a while (well below the time limit), so kills often catch it running.

    Limited to 4 live deliveries across every worker and 2 per limit key (three tenants; flow
    control): kills, restarts and outages must not lose a slot for good nor a message.
    """
    time.sleep(float(message.payload["sleep"]))
    record(message, "ok")


def fanned_out(message: Message) -> None:
    """A subscription of chaos.fanout (DESIGN invariant 28); "flaky" fails its first run."""
    if message.subscription == "flaky" and message.attempts <= 1:
        record(message, "retry")
        raise RetryableError("chaos: this subscription again", delay=0.3)
    record(message, "ok")


for _name in FANOUT:
    outbox.handler("chaos.fanout", name=_name)(fanned_out)


def late(message: Message) -> None:
    """A subscription of chaos.late, a type whose first events are written before any worker
    registered its subscriptions (DESIGN invariant 28); "notify" fails its first run."""
    if message.subscription == "notify" and message.attempts <= 1:
        record(message, "retry")
        raise RetryableError("chaos: this subscription again", delay=0.3)
    record(message, "ok")


for _name in LATE:
    outbox.handler("chaos.late", name=_name)(late)


def group_fanned(message: Message) -> None:
    """A subscription of chaos.group_fan, the callback of every other group (invariants 28 and
    29): the group's finalize fans it out, one row per subscription."""
    record(message, "ok")


for _name in GROUP_FAN:
    outbox.handler("chaos.group_fan", name=_name)(group_fanned)
