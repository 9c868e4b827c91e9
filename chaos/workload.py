"""The messages of a chaos run: a deterministic mix, and the thread that enqueues it over time."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import psycopg

from outbox_celery import Event
from outbox_celery.produce.enqueue import enqueue_group, enqueue_many

from .services import connect

__all__ = [
    "DATABASES",
    "DSN_ENV",
    "EFFECTS_DDL",
    "FANOUT",
    "GROUP_FAN",
    "HEALTHY",
    "KINDS",
    "LATE",
    "PERMANENT_ERROR",
    "SUBSCRIBED",
    "Producer",
    "for_database",
    "group_database",
    "plan",
    "plan_early",
    "plan_groups",
]

#: The databases of the run, by the name the Outbox serves them under (``databases=``): two on
#: the same server. Every event's payload names the one it is written to (``db``), so the end
#: check can tell each handler run's ``message.database`` from where its event was written.
DATABASES = ("one", "two")
#: database -> the environment variable that gives the workers its DSN (chaos/app.py).
DSN_ENV = dict(zip(DATABASES, ("CHAOS_DSN", "CHAOS_DSN_TWO"), strict=True))

# The text a permanent message's handler raises; the end check looks for it in last_error.
PERMANENT_ERROR = "chaos: permanent failure"

# The effect table of the transactional kind: one row per committed handler run. The end
# check wants exactly one per done "tx" message, whatever the faults did.
EFFECTS_DDL = """
CREATE TABLE IF NOT EXISTS chaos_effects (
    n bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    outbox_id bigint NOT NULL,
    lease_version bigint NOT NULL
)
"""

# kind -> share of the messages. Every kind but "permanent" must end done.
KINDS: dict[str, float] = {
    "ok": 0.47,
    "batch": 0.06,
    "tx": 0.06,
    "retry": 0.10,
    "permanent": 0.04,
    "defer": 0.06,
    "ordered": 0.10,
    "slow": 0.06,
    # Subscriptions (DESIGN invariant 28): one event, three named handlers (FANOUT), half of
    # them ordered per key; "flaky" fails retryably on its first run.
    "fanout": 0.04,
    # Subscriptions registered late (DESIGN invariant 28, "who started first does not matter"):
    # the runner writes a batch of chaos.late events before any worker registered its
    # subscriptions (bare rows, fanned out by the first claim, plan_early); these, written
    # during the run, are fanned out at write. Half are ordered per key.
    "late": 0.03,
}
#: The subscriptions of chaos.fanout; the end check wants every one to have a row per event.
FANOUT = ("audit", "flaky", "mail")
#: The subscriptions of chaos.late, registered by the workers only (never before the first
#: events); "notify" fails retryably on its first run.
LATE = ("archive", "index", "notify")
#: The subscriptions of chaos.group_fan, the callback type of every other group (invariant 29):
#: its finalize fans the callback out to both.
GROUP_FAN = ("ledger", "notify")
#: kind -> its subscriptions: the end check wants, for every event of the kind, exactly one row
#: per subscription, all done, and no bare row (an event_type without "@") left.
SUBSCRIBED: dict[str, tuple[str, ...]] = {"fanout": FANOUT, "late": LATE, "group_fan": GROUP_FAN}
# Groups with a callback (DESIGN invariant 29): members ("member") and callbacks ("group_done",
# "group_fan") are written apart from the mix, one group per transaction; all must end done.
HEALTHY = frozenset(KINDS) - {"permanent"} | {"member", "group_done", "group_fan"}

#: A group of the run: its members and its callback.
Group = tuple[list[Event], Event]


def group_database(g: int) -> str:
    """The database of group ``g``: pairs of groups alternate, so each database has groups of
    both callback types (``chaos.group_done`` for even groups, ``chaos.group_fan`` for odd)."""
    return DATABASES[(g // 2) % len(DATABASES)]


def plan_groups(groups: int, size: int) -> list[Group]:
    """``groups`` groups of ``size`` members, each with its callback: ``chaos.group_done`` for
    even groups, ``chaos.group_fan`` (two subscriptions, :data:`GROUP_FAN`) for odd ones, whose
    payload's ``n`` is the group's number. Each group lives in one database
    (:func:`group_database`), named by every payload's ``db``."""
    out: list[Group] = []
    for g in range(groups):
        db = group_database(g)
        members = [
            Event("chaos.member", {"kind": "member", "group": g, "i": i, "db": db}, "chaos", f"g{g}:{i}")
            for i in range(size)
        ]
        then = (
            Event("chaos.group_done", {"kind": "group_done", "group": g, "db": db}, "chaos", f"g{g}")
            if g % 2 == 0
            else Event(
                "chaos.group_fan", {"kind": "group_fan", "group": g, "n": g, "db": db}, "chaos", f"g{g}"
            )
        )
        out.append((members, then))
    return out


def plan_early(count: int, keys: int, first: int) -> list[Event]:
    """``count`` ``chaos.late`` events the runner writes before any worker registered the
    type's subscriptions: bare rows until a claim fans them out. Their ``n`` follow the mix's
    (from ``first``); a third are ordered, on keys of their own (``early-key-*``), so no event of
    the run shares a key with them (a bare event fanned out after its subscription already had
    later events of its key is delivered after them: a known limit, not what is checked).
    They alternate between the databases (``db``)."""
    rng = random.Random(first)
    return [
        Event(
            "chaos.late",
            {"kind": "late", "n": first + i, "early": True, "db": DATABASES[i % len(DATABASES)]},
            "chaos",
            f"early-{i}",
            ordering_key=f"early-key-{rng.randrange(keys)}" if rng.random() < 1 / 3 else None,
        )
        for i in range(count)
    ]


def plan(count: int, keys: int, seed: int, slow_max: float, batch: int = 25) -> list[Event]:
    """``count`` events in a shuffled, reproducible mix of :data:`KINDS`, spread over the
    databases a ``batch`` (the producer's transaction) at a time: events ``0..batch-1`` in the
    first, the next ``batch`` in the second, and so on (``db`` in each payload). Every kind and
    ordering key thus has events in both databases; each database orders its own."""
    rng = random.Random(seed)
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=count)
    events: list[Event] = []
    for n, kind in enumerate(kinds):
        db = DATABASES[(n // batch) % len(DATABASES)]
        payload: dict[str, object] = {"kind": kind, "n": n, "db": db}
        key: str | None = None
        limit_key: str | None = None
        if kind == "retry":
            payload["fail"] = rng.choice((1, 1, 2))
        elif kind == "defer":
            payload["delay"] = round(rng.uniform(0.3, 1.5), 2)
        elif kind == "slow":
            payload["sleep"] = round(rng.uniform(0.2, slow_max), 2)
            # Limits per key (DESIGN invariant 24): three tenants, at most two each at once.
            limit_key = f"tenant-{rng.randrange(3)}"
        elif kind == "tx":
            payload["sleep"] = round(rng.uniform(0.0, slow_max / 2), 2)
        elif kind == "ordered":
            key = f"key-{rng.randrange(keys)}"
        elif kind == "fanout" and rng.random() < 0.5:
            key = f"fan-key-{rng.randrange(keys)}"
        elif kind == "late" and rng.random() < 0.5:
            key = f"late-key-{rng.randrange(keys)}"
        elif kind == "batch":
            # Batch handlers: some items fail retryably on their first run, a third are
            # ordered (at most one per key per batch), the batch sleeps so kills land mid-batch.
            payload["fail"] = rng.choice((0, 0, 0, 1))
            payload["sleep"] = round(rng.uniform(0.0, slow_max / 4), 2)
            if rng.random() < 1 / 3:
                key = f"batch-key-{rng.randrange(keys)}"
        events.append(Event(f"chaos.{kind}", payload, "chaos", str(n), ordering_key=key, limit_key=limit_key))
    return events


def for_database(events: list[Event], database: str) -> list[Event]:
    """The events of ``events`` written to ``database`` (by their payload's ``db``)."""
    return [e for e in events if e.payload["db"] == database]


@dataclass
class Producer:
    """Enqueues ``events`` into ``database`` in batches at a steady rate from a thread, through
    every fault. One producer per database: a database that is down holds back its own only.

    A batch whose commit fails is retried on a new connection. If the commit did land before the
    connection broke, the batch is written twice: harmless, the end check judges whatever rows
    the table holds (and says how many there are).
    """

    database: str
    dsn: str
    events: list[Event]
    seconds: float
    batch: int = 25
    produced: int = 0
    failures: int = 0
    finished_at: float | None = None
    #: Groups written among the batches, one per transaction, spread over the same time.
    groups: list[Group] | None = None

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"chaos-producer-{self.database}", daemon=True)

    def start(self) -> None:
        """Start producing."""
        self._thread.start()

    def stop(self) -> None:
        """Stop early (an interrupted run) and wait for the thread."""
        self._stop.set()
        self._thread.join(30)

    @property
    def done(self) -> bool:
        """Whether every event was enqueued."""
        return self.finished_at is not None

    def _items(self) -> list[list[Event] | Group]:
        """The transactions to write in order: the batches, the groups spread among them."""
        batches: list[list[Event] | Group] = [
            self.events[i : i + self.batch] for i in range(0, len(self.events), self.batch)
        ]
        groups = self.groups or []
        out: list[list[Event] | Group] = []
        for k, b in enumerate(batches):
            out.append(b)
            out += groups[k * len(groups) // len(batches) : (k + 1) * len(groups) // len(batches)]
        return out if batches else list(groups)

    def _run(self) -> None:
        begin = time.monotonic()
        items = self._items()
        per_second = len(items) / max(self.seconds, 0.1)
        conn: psycopg.Connection[object] | None = None
        i = 0
        while i < len(items) and not self._stop.is_set():
            # Keep to the schedule: transaction i is due at i / rate seconds after the start.
            due = begin + i / per_second
            if (delay := due - time.monotonic()) > 0:
                self._stop.wait(delay)
                continue
            item = items[i]
            try:
                if conn is None or conn.closed:
                    conn = connect(self.dsn)
                with conn.transaction():
                    if isinstance(item, tuple):
                        enqueue_group(conn, item[0], then=item[1])
                    else:
                        enqueue_many(conn, item)
            except psycopg.Error:
                # PostgreSQL restarting or our backend killed: wait a moment, then reconnect.
                self.failures += 1
                if conn is not None:
                    conn.close()
                conn = None
                self._stop.wait(0.5)
                continue
            i += 1
            self.produced += len(item[0]) if isinstance(item, tuple) else len(item)
        if conn is not None:
            conn.close()
        self.finished_at = time.monotonic()
