"""The end check: each database's outbox table against what the handlers recorded in it, and the
summary table.

Row ids, ordering keys, effect rows and groups are each database's own, so every invariant is
checked per database (:func:`check`, :func:`check_groups`, :func:`check_subscribed` on one
database's rows and handler runs); :class:`Report` holds the verdicts of both, and the runs
recorded in another database than the one their event was written to.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .workload import HEALTHY, PERMANENT_ERROR, SUBSCRIBED

# The transactional kind: its effects must be exactly once, not at least once.
TRANSACTIONAL = "tx"

__all__ = [
    "Fanned",
    "FaultRecord",
    "Report",
    "Verdict",
    "check",
    "check_groups",
    "check_subscribed",
    "load_seen",
    "render",
    "split_seen",
]


@dataclass
class FaultRecord:
    """One injected (or skipped) fault and what the outbox did meanwhile."""

    name: str
    at: float  # seconds since the run started
    clock: str  # UTC wall clock, HH:MM:SS
    detail: str = ""
    seconds: float = 0.0  # how long the fault lasted
    delivered: int | None = None  # rows that became done during the fault (and its window)
    by_database: dict[str, int] = field(default_factory=dict)  # the same, per database
    skipped: str | None = None
    error: str | None = None


@dataclass
class Fanned:
    """The rows of one subscribed kind (DESIGN invariant 28), event by event."""

    subscriptions: int
    #: Events: an event is its first subscription's row and the rows reading its payload
    #: (``payload_of``), or a bare row (its type without a subscription's name).
    events: int = 0
    #: Events with exactly one row per subscription, every one done.
    complete: int = 0
    rows: int = 0
    #: Bare rows left: written before the subscriptions were registered and never fanned out.
    bare: list[int] = field(default_factory=list)
    #: Fanned-out events without exactly one done row per subscription (by their first row's id).
    incomplete: list[int] = field(default_factory=list)
    #: Planned events (their payload's ``n``) without any row.
    missing: list[str] = field(default_factory=list)


@dataclass
class Verdict:
    """Everything the end check found; ``violations`` empty means the run passed."""

    rows: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    by_kind: dict[str, Counter[str]] = field(default_factory=dict)
    handler_runs: int = 0
    duplicates: int = 0
    duplicated_ids: int = 0
    inversions: int = 0
    stuck: list[int] = field(default_factory=list)
    healthy_dead: list[tuple[int, str]] = field(default_factory=list)
    permanent_wrong: list[tuple[int, str, str]] = field(default_factory=list)
    never_seen: list[int] = field(default_factory=list)
    #: Transactional messages whose effect rows are not exactly one when done (none otherwise).
    effects_wrong: list[tuple[int, str, int]] = field(default_factory=list)
    effects_checked: int = 0
    #: Groups (DESIGN invariant 29): how many, those not fired, callbacks not exactly one.
    groups: int = 0
    groups_not_fired: list[tuple[int, str]] = field(default_factory=list)
    callbacks_wrong: list[tuple[int, int]] = field(default_factory=list)
    #: Subscribed kinds (DESIGN invariant 28): kind -> its events, row by row (check_subscribed).
    subscribed: dict[str, Fanned] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)


@dataclass
class Report:
    """The verdicts of every database, and what only the whole run shows.

    ``violations`` (see :meth:`all_violations`) empty in every database and here means the run
    passed.
    """

    databases: dict[str, Verdict] = field(default_factory=dict)
    #: Handler runs, every database.
    handler_runs: int = 0
    #: Handler runs whose ``message.database`` is not the database their event was written to
    #: (the payload's ``db``), or names no database of the run.
    misplaced: list[dict[str, Any]] = field(default_factory=list)
    #: Violations of the whole run (faults, misplaced runs); each database's are in its verdict.
    violations: list[str] = field(default_factory=list)

    def all_violations(self) -> list[str]:
        """The run's violations, then each database's (prefixed with its name)."""
        out = list(self.violations)
        for name, v in self.databases.items():
            out += [f"database {name}: {text}" for text in v.violations]
        return out


def load_seen(path: Path) -> list[dict[str, Any]]:
    """Every handler run ``seen.jsonl`` recorded, in the order they ran."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            out.append(json.loads(line))
    return out


def split_seen(
    sightings: list[dict[str, Any]], databases: tuple[str, ...]
) -> tuple[dict[str, list[dict[str, Any]]], list[dict[str, Any]]]:
    """The handler runs of each database (by the ``message.database`` each recorded), and the
    misplaced ones: recorded in another database than the payload's ``db`` says its event was
    written to, or in none of ``databases``."""
    by_db: dict[str, list[dict[str, Any]]] = {db: [] for db in databases}
    misplaced: list[dict[str, Any]] = []
    for s in sightings:
        db = s.get("db")
        if db not in by_db or s.get("w") != db:
            misplaced.append(s)
        if db in by_db:
            by_db[db].append(s)
    return by_db, misplaced


def check_groups(
    v: Verdict, groups: list[tuple[int, str, int | None]], callbacks: list[tuple[int, int]]
) -> None:
    """Every group fired, and its callback committed exactly once: one callback row per group
    (by the group id its payload carries), the one the group's row names. A callback of a
    subscribed type (``chaos.group_fan``) is its first subscription's row, which holds the
    payload; its other subscriptions' rows are :func:`check_subscribed`'s.

    :param groups: (id, state, callback_id) of every group.
    :param callbacks: (outbox id, group id in its payload) of every callback row.
    """
    v.groups = len(groups)
    v.groups_not_fired = [(g, state) for g, state, _ in groups if state != "fired"]
    per_group: dict[int, list[int]] = defaultdict(list)
    for row_id, g in callbacks:
        per_group[g].append(row_id)
    for g, _state, callback_id in groups:
        if per_group.get(g, []) != ([callback_id] if callback_id is not None else []):
            v.callbacks_wrong.append((g, len(per_group.get(g, []))))
    if v.groups_not_fired:
        v.violations.append(f"{len(v.groups_not_fired)} group(s) not fired (left open, or skipped)")
    if v.callbacks_wrong:
        v.violations.append(f"{len(v.callbacks_wrong)} group(s) whose callback is not committed exactly once")


def check_subscribed(
    v: Verdict,
    rows: list[tuple[int, str, int | None, str, object]],
    planned: dict[str, set[int]] | None = None,
) -> None:
    """Every event of a subscribed kind (:data:`~chaos.workload.SUBSCRIBED`) reached every
    subscription: exactly one row per subscription, all done; no bare row left; and every
    planned event has rows. Delivery itself is at least once: :func:`check` wants a successful
    handler run for every done row.

    :param rows: (id, event_type, payload_of, status, the payload's ``n``) of every row of a
        subscribed type; ``n`` is set on the row that holds the payload (an event's first
        subscription's, or a bare row), ``None`` on the rows that read it.
    :param planned: kind -> the ``n`` of the events the run wrote (the producer may write a
        batch twice: then both copies must be complete).
    """
    events: dict[str, dict[int, list[tuple[str, str]]]] = defaultdict(lambda: defaultdict(list))
    tags: dict[str, set[str]] = defaultdict(set)
    for row_id, event_type, payload_of, status, n in rows:
        kind, _, name = event_type.removeprefix("chaos.").partition("@")
        if kind not in SUBSCRIBED:
            continue
        sub = v.subscribed.setdefault(kind, Fanned(len(SUBSCRIBED[kind])))
        sub.rows += 1
        if n is not None:
            tags[kind].add(str(n))
        if not name:
            sub.bare.append(row_id)
            continue
        events[kind][payload_of if payload_of is not None else row_id].append((name, status))
    for kind, sub in v.subscribed.items():
        want = sorted(SUBSCRIBED[kind])
        for root, got in sorted(events[kind].items()):
            if sorted(name for name, _ in got) == want and all(s == "done" for _, s in got):
                sub.complete += 1
            else:
                sub.incomplete.append(root)
        sub.events = len(events[kind]) + len(sub.bare)
    for kind, ns in (planned or {}).items():
        sub = v.subscribed.setdefault(kind, Fanned(len(SUBSCRIBED[kind])))
        sub.missing = sorted({str(n) for n in ns} - tags[kind], key=lambda t: (len(t), t))
    for kind, sub in sorted(v.subscribed.items()):
        if sub.bare:
            v.violations.append(f"{len(sub.bare)} bare chaos.{kind} row(s) left (never fanned out)")
        if sub.incomplete:
            v.violations.append(
                f"{len(sub.incomplete)} chaos.{kind} event(s) without exactly one done row per subscription"
            )
        if sub.missing:
            v.violations.append(f"{len(sub.missing)} planned chaos.{kind} event(s) without a row")


def check(
    rows: list[tuple[int, str, str, str | None, str | None]],
    sightings: list[dict[str, Any]] | Path,
    *,
    effects: dict[int, int] | None = None,
) -> Verdict:
    """Judge one database from its ``rows`` (id, event_type, status, ordering_key, last_error)
    and the handler runs recorded in it (``sightings``, in the order they ran; or the path of a
    ``seen.jsonl`` whose runs are all this database's).

    :param effects: outbox id -> effect rows of the transactional kind (that database's
        ``chaos_effects``): exactly one for every done ``tx`` message, none for the others.
    """
    v = Verdict(rows=len(rows))
    if isinstance(sightings, Path):
        sightings = load_seen(sightings)
    v.handler_runs = len(sightings)
    delivered: Counter[int] = Counter(s["id"] for s in sightings if s["o"] == "ok")
    v.duplicates = sum(n - 1 for n in delivered.values() if n > 1)
    v.duplicated_ids = sum(1 for n in delivered.values() if n > 1)

    by_kind: dict[str, Counter[str]] = defaultdict(Counter)
    routes: Counter[str] = Counter()
    for row_id, event_type, status, _key, error in rows:
        kind = event_type.removeprefix("chaos.")
        by_kind[kind][status] += 1
        if "@" in kind:  # a subscription's row: its kind is the event type's (invariant 28)
            routes[kind] += 1
            kind = kind.partition("@")[0]
        v.by_status[status] = v.by_status.get(status, 0) + 1
        if status not in ("done", "dead"):
            v.stuck.append(row_id)
        elif kind == "permanent":
            if status != "dead" or PERMANENT_ERROR not in (error or ""):
                v.permanent_wrong.append((row_id, status, (error or "")[:120]))
        elif kind in HEALTHY and status == "dead":
            v.healthy_dead.append((row_id, (error or "")[:120]))
        elif status == "done" and delivered[row_id] == 0:
            v.never_seen.append(row_id)
    v.by_kind = dict(by_kind)
    if effects is not None:
        for row_id, event_type, status, _key, _error in rows:
            if event_type.removeprefix("chaos.") != TRANSACTIONAL:
                continue
            v.effects_checked += 1
            n = effects.get(row_id, 0)
            if n != (1 if status == "done" else 0):
                v.effects_wrong.append((row_id, status, n))

    # Ordered keys: in the order handlers ran, an id below one already seen on its key is an
    # inversion (a retry of the same head is not).
    highest: dict[str, int] = {}
    for s in sightings:
        key = s.get("k")
        if key is None:
            continue
        if s["id"] < highest.get(key, -1):
            v.inversions += 1
        highest[key] = max(highest.get(key, -1), s["id"])

    v.violations += _fanned_out_short(routes)
    if v.stuck:
        v.violations.append(f"{len(v.stuck)} row(s) lost or stuck (not done/dead after the drain)")
    if v.healthy_dead:
        v.violations.append(f"{len(v.healthy_dead)} healthy message(s) dead")
    if v.permanent_wrong:
        v.violations.append(f"{len(v.permanent_wrong)} permanent message(s) not dead with their error")
    if v.never_seen:
        v.violations.append(f"{len(v.never_seen)} row(s) done without a successful handler run")
    if v.inversions:
        v.violations.append(f"{v.inversions} ordering inversion(s)")
    if v.effects_wrong:
        v.violations.append(
            f"{len(v.effects_wrong)} transactional message(s) whose effect is not exactly once"
        )
    return v


def _fanned_out_short(routes: Counter[str]) -> list[str]:
    """Every subscription of a subscribed kind has as many rows as its siblings: none fanned
    out short (the event by event check is :func:`check_subscribed`)."""
    out = []
    for kind, names in SUBSCRIBED.items():
        fanned = {f"{kind}@{name}": routes[f"{kind}@{name}"] for name in names}
        if any(fanned.values()) and len(set(fanned.values())) != 1:
            out.append(f"subscriptions with different numbers of rows: {fanned}")
    return out


def _outcome(v: Verdict) -> list[str]:
    """One database's outcome: rows by status and kind, runs, and what its checks found."""
    lines = [f"  rows {v.rows}: " + ", ".join(f"{s} {n}" for s, n in sorted(v.by_status.items()))]
    for kind, counts in sorted(v.by_kind.items()):
        lines.append(f"    {kind:<10} " + ", ".join(f"{s} {n}" for s, n in sorted(counts.items())))
    lines.append(f"  handler runs {v.handler_runs}")
    lines.append(f"  duplicates   {v.duplicates} extra successful run(s) over {v.duplicated_ids} message(s)")
    lines.append(f"  inversions   {v.inversions}")
    if v.groups:
        lines.append(
            f"  groups       {v.groups}, {len(v.groups_not_fired)} not fired, "
            f"{len(v.callbacks_wrong)} callbacks not once"
        )
    for kind, sub in sorted(v.subscribed.items()):
        lines.append(
            f"  subscribed   chaos.{kind}: {sub.complete} of {sub.events} event(s) with one done row "
            f"in each of {sub.subscriptions} subscriptions ({sub.rows} rows), {len(sub.bare)} bare left"
            + (f", {len(sub.missing)} planned missing" if sub.missing else "")
        )
        if sub.incomplete:
            lines.append(f"  incomplete   chaos.{kind} {sub.incomplete[:20]}")
        if sub.bare:
            lines.append(f"  bare left    chaos.{kind} {sub.bare[:20]}")
        if sub.missing:
            lines.append(f"  missing      chaos.{kind} n={sub.missing[:20]}")
    if v.effects_checked:
        lines.append(
            f"  tx effects   {v.effects_checked - len(v.effects_wrong)} of {v.effects_checked} "
            "transactional message(s) with exactly one effect per done"
        )
    for row_id, status, n in v.effects_wrong[:10]:
        lines.append(f"  tx effect    {row_id} {status}: {n} effect row(s)")
    if v.stuck:
        lines.append(f"  stuck ids    {v.stuck[:20]}{' ...' if len(v.stuck) > 20 else ''}")
    for row_id, error in v.healthy_dead[:10]:
        lines.append(f"  healthy dead {row_id}: {error}")
    for row_id, status, error in v.permanent_wrong[:10]:
        lines.append(f"  permanent    {row_id} {status}: {error}")
    if v.never_seen:
        lines.append(f"  never seen   {v.never_seen[:20]}")
    return lines


def render(
    v: Verdict | Report,
    faults: list[FaultRecord],
    facts: list[tuple[str, str]],
) -> str:
    """The summary printed at the end of a run: for a :class:`Report`, each database's outcome,
    then the run's; a lone :class:`Verdict` is shown as one database."""
    report = v if isinstance(v, Report) else Report(databases={"": v}, handler_runs=v.handler_runs)
    names = [name for name in report.databases if name]
    lines: list[str] = []
    width = max(len(k) for k, _ in facts) if facts else 10
    lines.append("== chaos run ==")
    for k, val in facts:
        lines.append(f"  {k:<{width}}  {val}")
    lines.append("")
    lines.append("== faults ==")
    split = "/".join(names) if names else ""
    lines.append(
        f"  {'t+s':>6}  {'utc':<8}  {'fault':<16}  {'lasted':>7}  {'delivered':>9}"
        + (f"  {split:>9}" if names else "")
        + "  detail"
    )
    for f in faults:
        each = ""
        if names:
            each = "/".join(str(f.by_database.get(n, 0)) for n in names) if f.by_database else "-"
            each = f"  {each:>9}"
        if f.skipped:
            lines.append(
                f"  {f.at:>6.1f}  {f.clock:<8}  {f.name:<16}  {'-':>7}  {'-':>9}"
                + (f"  {'-':>9}" if names else "")
                + f"  SKIPPED: {f.skipped}"
            )
            continue
        got = "-" if f.delivered is None else str(f.delivered)
        text = f.detail + (f"  ERROR: {f.error}" if f.error else "")
        lines.append(
            f"  {f.at:>6.1f}  {f.clock:<8}  {f.name:<16}  {f.seconds:>6.1f}s  {got:>9}{each}  {text}"
        )
    for name, verdict in report.databases.items():
        lines.append("")
        lines.append(f"== outcome: database {name} ==" if name else "== outcome ==")
        lines += _outcome(verdict)
    if names:
        lines.append("")
        lines.append("== outcome: the run ==")
        rows = sum(verdict.rows for verdict in report.databases.values())
        lines.append(f"  rows         {rows} in {len(names)} databases")
        lines.append(f"  handler runs {report.handler_runs}")
        lines.append(
            f"  misplaced    {len(report.misplaced)} handler run(s) in another database than the one "
            "their event was written to"
        )
        for s in report.misplaced[:10]:
            lines.append(
                f"  misplaced    id {s.get('id')} {s.get('t')}: ran in {s.get('db')}, written to {s.get('w')}"
            )
    lines.append("")
    violations = report.all_violations() if names else v.violations
    if violations:
        lines.append("VERDICT: FAIL")
        lines.extend(f"  - {text}" for text in violations)
    else:
        lines.append("VERDICT: PASS")
    return "\n".join(lines)
