"""The claim's planner: what one claim takes, decided without a database.

Pure functions over typed values. Each step of a claim (:mod:`outbox_celery.claim.executor`, the
executor) reads something, hands it to the planner, and runs the statements the planner's
answer names: which flow rows to lock and count (DESIGN invariant 22), how many rows of each
limited type its expired leases and its new rows may take (invariants 22, 24), which batch
handlers' types wait to fill (invariant 21), how long until a claim can take more, and which
flow rows to write back. A claim's later statements depend on how many rows its earlier ones
returned, so the plan is made step by step, each step from what the previous one read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import NamedTuple

from ..flow import CAP_RECHECK, LIMIT_RECHECK, Allowance, Limit, allowance

__all__ = [
    "CLOCK_STEP",
    "MAX_KEYS_WALKED",
    "MIN_KEYS_WALKED",
    "FillRow",
    "FlowPlan",
    "FlowRead",
    "FlowRow",
    "FlowWrites",
    "KeyWalk",
    "KeyedRow",
    "Seen",
    "flow_read",
    "flow_wait",
    "flow_writes",
    "keyed_walks",
    "plan_flow",
]

#: Seconds a rate bucket may be refilled ahead of the database's now() (concurrent claimers'
#: transactions began at different times); further ahead, the clock stepped back (the same
#: 60 seconds are written in claim_keyed and flow_spend).
CLOCK_STEP = 60.0
#: Limit keys one claim walks per keyed event type, at least and at most (DESIGN invariant 24):
#: twice its room, within these. Keys beyond are walked by the next claims (round robin).
MIN_KEYS_WALKED = 50
MAX_KEYS_WALKED = 1000


# -- rows the planner reads (one type per query result) ------------------------------------------


@dataclass(frozen=True, slots=True)
class Seen:
    """What a claim's first statement read, without a lock (``claim_settings_flow``)."""

    #: The transaction's now().
    now: datetime | None
    #: Event types that have a flow row.
    known: frozenset[str] = frozenset()
    #: Types paused or held by a RateLimited outcome.
    held: frozenset[str] = frozenset()
    #: Seconds until the earliest hold of a type ends.
    held_for: float | None = None
    #: Types with a limit key paused or held (claimed key by key).
    key_types: tuple[str, ...] = ()
    #: Seconds until the earliest hold of a key ends.
    key_held_for: float | None = None


class FlowRow(NamedTuple):
    """One locked flow row (``flow_lock``)."""

    event_type: str
    paused: bool
    held: bool
    held_for: float | None
    tokens: float | None
    since_refill: float | None
    key_cursor: str | None
    at_cap: bool


class FillRow(NamedTuple):
    """One batch handler's type as ``fill_due`` counted it."""

    event_type: str
    n: int
    waited: float | None


class KeyedRow(NamedTuple):
    """One row of ``claim_keyed``: a claimed row (``id`` set), or the marker row (``id`` None)
    that carries the last key walked, the keys left at their cap with a row due, and the
    seconds until a key held by its key_rate alone has a token."""

    id: int | None
    lease_version: int | None
    event_type: str | None
    lease_until: datetime | None
    available_at: datetime | None
    limit_key: str | None
    pos: int | None
    blocked: int | None
    token_wait: float | None
    attempts: int | None


# -- what the planner decides ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FlowPlan:
    """Which flow statements a claim runs before it claims (DESIGN invariants 22 to 25)."""

    #: The limits this claim applies: the declared ones of the types it claims, and a Limit
    #: without bounds for every type with a held or paused key (claimed key by key).
    limits: Mapping[str, Limit]
    #: Types without a flow row yet: inserted first, before any flow lock (one lock order).
    add: tuple[str, ...]
    #: Types whose flow rows are locked (event-type order); empty: no flow statement at all.
    lock: tuple[str, ...]
    #: Keyed types whose ran-out key holds are cleared under their type's lock.
    clear_keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class FlowRead:
    """The flow-control state one claim read under its rows' locks (DESIGN invariant 22)."""

    #: Types paused or held by a RateLimited outcome: claimed by nobody.
    held: frozenset[str]
    #: Seconds until the earliest RateLimited hold ends (``None``: none).
    held_for: float | None
    #: Allowance of each limited type that is not held.
    allowances: dict[str, Allowance]
    #: Where the next claim of each keyed type starts walking its keys (DESIGN invariant 24).
    cursors: dict[str, str | None] = field(default_factory=dict)
    #: The at_cap flag of each type as the previous claim left it.
    at_cap: dict[str, bool] = field(default_factory=dict)
    #: Rate-limited types whose bucket was refilled ahead of now() (the clock stepped back).
    reclock: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class KeyWalk:
    """One keyed event type within one claim (DESIGN invariant 24)."""

    #: Live deliveries at most per limit key (``None``: no bound per key).
    key_cap: int | None
    #: Starts per second at most per limit key, and its bucket's size (``None``: no bound).
    key_rate: float | None
    key_burst: float | None
    #: The key after which this claim walks its keys (round robin).
    cursor: str | None
    #: Whether the cursor moved (written back to the flow row).
    moved: bool = False
    #: Whether a key at its cap had a row due (the listener claims again soon).
    blocked: bool = False
    #: Seconds until a key held by its key_rate alone has its next token (``None``: none).
    token_wait: float | None = None

    def max_keys(self, room: int, batch: int) -> int:
        """Keys one walk reads: twice the room (at most a batch's), within the bounds."""
        return min(MAX_KEYS_WALKED, max(2 * min(room, max(batch, 1)), MIN_KEYS_WALKED))

    def after(self, rows: Sequence[KeyedRow], room: int) -> KeyWalk:
        """The walk after ``claim_keyed`` returned ``rows`` for ``room``: where the next claim
        starts, and whether a key at its cap or short of a token held a row back."""
        taken = [r for r in rows if r.id is not None]
        marker = next((r for r in rows if r.id is None), None)
        blocked, wait = self.blocked, self.token_wait
        if marker is not None and marker.blocked:
            blocked = True
        if marker is not None and marker.token_wait is not None:
            wait = marker.token_wait if wait is None else min(wait, marker.token_wait)
        if taken and len(taken) >= room:
            # Stopped by the room: the next claim starts after the last key served.
            cursor = max(taken, key=lambda r: r.pos or 0).limit_key
        else:
            # Every key walked offered what it could: the next claim walks on from the last.
            cursor = marker.limit_key if marker is not None else None
        moved = cursor is not None and cursor != self.cursor
        return KeyWalk(
            self.key_cap,
            self.key_rate,
            self.key_burst,
            cursor if moved else self.cursor,
            self.moved or moved,
            blocked,
            wait,
        )


@dataclass(frozen=True, slots=True)
class FlowWrites:
    """The flow rows a claim writes back, each only when it changed."""

    #: (type, key) cursors that moved.
    cursors: tuple[tuple[str, str], ...] = ()
    #: (type, tokens left) of the rate buckets this claim took from or re-clocked.
    buckets: tuple[tuple[str, float], ...] = ()
    #: (type, flag) of the at_cap flags that changed.
    at_cap: tuple[tuple[str, bool], ...] = ()


# -- the steps ---------------------------------------------------------------------------------------


def plan_flow(limits: Mapping[str, Limit], seen: Seen) -> FlowPlan:
    """The flow statements of a claim: none without a limit declared or a key held."""
    full = {**dict.fromkeys(seen.key_types, Limit()), **limits}
    lock = tuple(sorted(full))
    return FlowPlan(
        limits=full,
        add=tuple(t for t in lock if t not in seen.known),
        lock=lock,
        clear_keys=tuple(t for t in lock if t in seen.key_types),
    )


def held_after_lock(plan: FlowPlan, seen: Seen, rows: Sequence[FlowRow]) -> frozenset[str]:
    """Types held after the lock: the unlocked ones as ``seen`` read them, the locked ones as
    their rows say."""
    locked = frozenset(r.event_type for r in rows if r.paused or r.held)
    return (seen.held - frozenset(plan.lock)) | locked


def to_count(plan: FlowPlan, held: frozenset[str]) -> tuple[str, ...]:
    """Types whose live deliveries are counted: a concurrency declared, not held."""
    return tuple(t for t in plan.lock if plan.limits[t].concurrency is not None and t not in held)


def flow_read(plan: FlowPlan, seen: Seen, rows: Sequence[FlowRow], live: Mapping[str, int]) -> FlowRead:
    """The allowance of every limited type from its locked row and live count (invariant 22)."""
    held = held_after_lock(plan, seen, rows)
    holds = [r.held_for for r in rows if r.held and not r.paused and r.held_for is not None]
    held_for = min(holds + ([] if seen.held_for is None else [seen.held_for]), default=None)
    state = {r.event_type: r for r in rows}
    allowances: dict[str, Allowance] = {}
    reclock: set[str] = set()
    for t, lim in plan.limits.items():
        if t in held or t not in state:
            continue
        since = state[t].since_refill
        if since is not None and since < -CLOCK_STEP:
            # Refilled ahead of now(): the database's clock stepped back. Nothing refills for
            # the gap and the bucket counts from now() (written by flow_writes).
            reclock.add(t)
        allowances[t] = allowance(lim, live=live.get(t, 0), tokens=state[t].tokens, since_refill=since)
    return FlowRead(
        held=held,
        held_for=held_for,
        allowances=allowances,
        cursors={r.event_type: r.key_cursor for r in rows},
        at_cap={r.event_type: r.at_cap for r in rows},
        reclock=frozenset(reclock),
    )


def keyed_walks(limits: Mapping[str, Limit], flow: FlowRead, seen: Seen) -> dict[str, KeyWalk]:
    """The limited types claimed key by key: a key bound declared, or a key held or paused."""
    return {
        t: KeyWalk(
            limits[t].key_concurrency,
            limits[t].key_rate,
            limits[t].key_burst if limits[t].key_rate is not None else None,
            flow.cursors.get(t),
        )
        for t in sorted(flow.allowances)
        if limits[t].keyed or t in seen.key_types
    }


def fill_asks(fill: Mapping[str, tuple[int, float]], limit: int, excluded: frozenset[str]) -> dict[str, int]:
    """Batch handlers' types whose due rows ``fill_due`` counts, each up to a batch
    (``min(batch, limit)``: a claim never cuts a bigger one). Types left out anyway and
    ``max_wait`` 0 are not read."""
    types = sorted(t for t, (_batch, wait) in fill.items() if wait > 0 and t not in excluded)
    return {t: max(1, min(fill[t][0], limit)) for t in types}


def filling(fill: Mapping[str, tuple[int, float]], limit: int, rows: Sequence[FillRow]) -> dict[str, float]:
    """Types left to fill a batch (DESIGN invariant 21), each with the seconds it may wait:
    due rows, fewer than a batch, the oldest due less than ``max_wait``."""
    out: dict[str, float] = {}
    for row in rows:
        batch, max_wait = fill[row.event_type]
        if row.n == 0 or row.waited is None or row.n >= min(batch, limit) or row.waited >= max_wait:
            continue
        out[row.event_type] = max(0.0, max_wait - row.waited)
    return out


def expired_asks(allowances: Mapping[str, Allowance], expired_limit: int) -> dict[str, int]:
    """Expired leases of each limited type to re-claim: at most its allowance (invariant 22)."""
    return {t: min(a.rows, expired_limit) for t, a in sorted(allowances.items())}


def half(room: int) -> int:
    """The ordered heads' first share of a room (neither heads nor pending rows starve)."""
    return max(1, (room + 1) // 2)


def fresh_rooms(
    allowances: Mapping[str, Allowance], spent: Mapping[str, int], limit: int
) -> tuple[int, dict[str, int]]:
    """Each limited type's first room for new rows, and the share it was cut to: each limited
    type and the unlimited rest share the batch, so neither starves the other."""
    share = max(1, limit // (len(allowances) + 1))
    rooms = {t: min(a.rows - spent[t], share) for t, a in sorted(allowances.items())}
    cap = limit
    if sum(max(0, r) for r in rooms.values()) > cap:
        # A batch smaller than the types: the first types in order get one row each.
        for t in rooms:
            rooms[t] = min(max(0, rooms[t]), cap)
            cap -= rooms[t]
    return share, rooms


def more_rooms(
    allowances: Mapping[str, Allowance], spent: Mapping[str, int], share: int, left: int
) -> dict[str, int]:
    """What is left of the batch, to the limited types that filled their share, in order."""
    more: dict[str, int] = {}
    for t, allowed in sorted(allowances.items()):
        room = min(allowed.rows - spent[t], left)
        if room > 0 and spent[t] >= share:
            more[t] = room
            left -= room
    return more


def heads_again(
    rooms: Mapping[str, int], got: Mapping[str, int], heads: Mapping[str, int], shares: Mapping[str, int]
) -> dict[str, int]:
    """Pending rows ran short: the ordered heads of a type that filled its share take the rest."""
    return {t: r - got[t] for t, r in rooms.items() if got[t] and heads.get(t, 0) >= shares[t] and r > got[t]}


def flow_wait(
    flow: FlowRead | None,
    limits: Mapping[str, Limit],
    spent: Mapping[str, int],
    walks: Mapping[str, KeyWalk],
    *,
    filling: Mapping[str, float],
    key_held_for: float | None,
) -> float | None:
    """Seconds until a claim can take more of what this one kept back (``None``: nothing)."""
    waits: list[float] = []
    if flow is not None and flow.held_for is not None:
        waits.append(flow.held_for)
    if filling:
        waits.append(min(filling.values()))
    if walks and key_held_for is not None:
        waits.append(key_held_for)
    for t, allowed in sorted(flow.allowances.items() if flow is not None else ()):
        wait = allowed.wait(limits[t], spent.get(t, 0))
        if wait is not None:
            waits.append(wait)
    if any(w.blocked for w in walks.values()):
        # A key at its key_concurrency: its finishes wake the claim (at_cap).
        waits.append(CAP_RECHECK)
    waits += [max(LIMIT_RECHECK, w.token_wait) for w in walks.values() if w.token_wait is not None]
    return min(waits) if waits else None


def flow_writes(
    flow: FlowRead, limits: Mapping[str, Limit], spent: Mapping[str, int], walks: Mapping[str, KeyWalk]
) -> FlowWrites:
    """The flow rows to write back: moved cursors, the buckets this claim took from (an untouched
    bucket refills from its last write when next read, so its versions follow the type's starts,
    invariant 18), and the at_cap flags that changed (finishes of a capped type wake the claim)."""
    buckets = {
        t: a.tokens - spent.get(t, 0)
        for t, a in flow.allowances.items()
        if a.tokens is not None and (spent.get(t, 0) > 0 or t in flow.reclock)
    }
    flags = {
        t: a.at_cap(limits[t], spent.get(t, 0)) or (t in walks and walks[t].blocked)
        for t, a in flow.allowances.items()
        if limits[t].concurrency is not None or limits[t].key_concurrency is not None
    }
    changed = sorted(t for t, f in flags.items() if f != flow.at_cap.get(t, False))
    return FlowWrites(
        cursors=tuple((t, w.cursor) for t, w in walks.items() if w.moved and w.cursor is not None),
        buckets=tuple((t, buckets[t]) for t in sorted(buckets)),
        at_cap=tuple((t, flags[t]) for t in changed),
    )
