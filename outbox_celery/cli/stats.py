"""``outbox-celery stats``: depth, ages, leases, attempts and event types at a glance, and what
needs a human now (:func:`attention`)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import click

from ..operated import OperatedOutbox
from ..ops import durations, snapshot
from ..ops.durations import CLAIM_OVERDUE_MARGIN, overdue_after
from .main import cli
from .options import duration, pass_target
from .output import echo_json, printable, text_table
from .target import DEFAULT_CLAIM_INTERVAL, Target

__all__ = ["HORIZON_ATTENTION_SECONDS", "attention", "stats"]


def _unstarted_line(e: snapshot.EventTypeStats, outbox: OperatedOutbox | None) -> str:
    """A queue with no consumer shows as claims nobody starts (DESIGN invariants 10, 16)."""
    queue = "its queue"
    if outbox is not None and e.event_type in outbox.handlers:
        queue = f"queue {outbox.queue_for(e.event_type)!r}"
    return (
        f"event type {e.event_type!r}: {e.unstarted} message(s) claimed up to {e.unstarted_claims} "
        f"time(s) without a worker starting them: does {queue} have a consumer?"
    )


def _unclaimed_after(target: Target) -> float:
    """``stats``' default threshold: the loaded Outbox's claim interval (or the default) and the
    margin of :func:`~outbox_celery.durations.overdue_after`."""
    return overdue_after(target.claim_interval)


def _unclaimed_line(u: snapshot.Unclaimed, outbox: OperatedOutbox | None, processing: int) -> str:
    """Ready messages nobody claims: the first sign of a stopped claim worker or a missing handler."""
    if outbox is not None:
        # Its event type has a handler here (those without one are reported as unroutable).
        cause = f"is a worker consuming the claim queue {outbox.config.claim_queue!r} running, and beat?"
    else:
        cause = (
            "no claim worker running (a worker consuming the claim queue, and beat), "
            "or no handler for this event type in the app that claims"
        )
    bound = f" (or the in-flight bound is full: {processing} processing)" if processing else ""
    return (
        f"event type {u.event_type!r}: {u.messages} ready message(s) unclaimed for "
        f"{durations.format_duration(u.oldest_wait)}: {cause}{bound}"
    )


def attention(
    s: snapshot.Stats, outbox: OperatedOutbox | None = None, unclaimed: Sequence[snapshot.Unclaimed] = ()
) -> list[str]:
    """What needs a human now, as short phrases (the figures that should be zero)."""
    items = []
    if s.dead:
        items.append(f"{s.shown('dead')} dead (outbox-celery dead list)")
    if s.blocked_keys:
        items.append(f"{s.blocked_keys} ordered key(s) blocked by a dead head")
    if s.headless_keys:
        items.append(f"{s.headless_keys} ordered key(s) without a head (outbox-celery repair-heads)")
    if s.groups.blocked:
        items.append(f"{s.groups.blocked} open group(s) with a dead member (outbox-celery groups list)")
    if s.expired_leases:
        items.append(f"{s.expired_leases} expired lease(s) (workers lost or stuck?)")
    if s.unroutable:
        items.append(f"no handler for {', '.join(map(printable, s.unroutable))}")
    items += [_unstarted_line(e, outbox) for e in s.event_types if e.unstarted]
    # Paused and held event types are left unclaimed on purpose; stats lists them below.
    reported = set(s.unroutable or ()) | {f.event_type for f in s.flow}
    items += [
        _unclaimed_line(u, outbox, s.counts["processing"]) for u in unclaimed if u.event_type not in reported
    ]
    h = s.horizon
    if h is not None and h.held_for_long(HORIZON_ATTENTION_SECONDS):
        items.append(
            f"the xmin horizon is held by {printable(h.holder())}: VACUUM cleans nothing meanwhile "
            f"({h.dead_row_versions:,} dead row versions in the outbox; docs/operations.md, "
            "long transactions)"
        )
    return items


# A snapshot held this long is worth a human's look (the claim stays fast, the table grows).
HORIZON_ATTENTION_SECONDS = 60.0


def _done_note(outbox: OperatedOutbox | None) -> str:
    """What the done count is: finished rows still kept, not rows already deleted."""
    if outbox is None:
        return "delivered or skipped, kept until retention deletes them"
    retention = outbox.config.retention
    if retention is None:
        return "delivered or skipped, kept (retention is off)"
    after = durations.format_duration(retention)
    return f"delivered or skipped, deleted by retention {after} after they finish"


@cli.command()
@click.option(
    "--unclaimed-after",
    metavar="DURATION",
    callback=duration,
    help="Report ready messages left unclaimed this long (default: a claim interval of the -A "
    f"Outbox plus {durations.format_duration(CLAIM_OVERDUE_MARGIN)}, else "
    f"{durations.format_duration(DEFAULT_CLAIM_INTERVAL + CLAIM_OVERDUE_MARGIN)}).",
)
@click.option(
    "--exact",
    is_flag=True,
    help=f"Count every row (the cost grows with the table) instead of reading each status up to "
    f"{snapshot.DEFAULT_STATS_CAP:,} index entries.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_target
def stats(target: Target, unclaimed_after: float | None, exact: bool, as_json: bool) -> None:
    """Health at a glance: depth, ages, leases, attempts, event types.

    Ready messages that no claim took within a claim interval (plus a margin) are flagged (a stopped claim
    worker or beat, or an event type no claiming app handles). With -A, pending event types
    that have no handler are reported as unroutable. Each status is read up to a cap (a count
    shown as N+ is at least N) and the done count past it is estimated: the command costs the
    same whatever the done history holds; --exact counts everything.
    """
    threshold = unclaimed_after if unclaimed_after is not None else _unclaimed_after(target)
    s, waiting = _read_stats(target, threshold, exact)
    needs = attention(s, target.outbox, waiting)
    if as_json:
        echo_json(
            {
                **s.as_dict(),
                "unclaimed_after": threshold,
                "unclaimed": [u.as_dict() for u in waiting],
                "attention": needs,
            }
        )
        return
    click.echo(f"outbox {target.where}")
    click.echo(f"database time {s.now:%Y-%m-%d %H:%M:%S %Z}")
    click.echo(f"attention: {'; '.join(needs) or 'none'}")
    click.echo("")
    _echo_status_counts(s, target.outbox)
    _echo_facts(s)
    _echo_attempts(s)
    _echo_event_types(s, target.handlers)
    _echo_flow(s)
    _echo_unroutable(s)


def _read_stats(
    target: Target, threshold: float, exact: bool
) -> tuple[snapshot.Stats, list[snapshot.Unclaimed]]:
    """``stats``' reads: the capped (or, with --exact, full) counts and the unclaimed event types."""
    cap = None if exact else snapshot.DEFAULT_STATS_CAP
    with target.connect() as conn:
        s = snapshot.stats(conn, target.table, handlers=target.handlers, cap=cap)
        waiting = snapshot.unclaimed(conn, target.table, older_than=threshold, cap=cap)
    return s, waiting


def _echo_status_counts(s: snapshot.Stats, outbox: OperatedOutbox | None) -> None:
    """The table of messages per status, each with what its figure means."""
    in_order = s.counts["pending"] - s.ready - s.scheduled
    notes = {
        "pending": f"{s.ready} ready now, {s.scheduled} scheduled later (delay/backoff/defer), "
        f"{in_order} waiting behind their ordering key's head",
        "processing": f"{s.expired_leases} with an expired lease",
        "dead": "need a human: outbox-celery dead list" if s.dead else "",
        "done": _done_note(outbox),
    }
    if s.capped.get("done"):
        notes["done"] = f"estimated (table statistics); {notes['done']}"
    if s.done_last_minute or s.counts["done"]:
        minute = f"{s.done_last_minute}+" if s.capped.get("done") else str(s.done_last_minute)
        notes["done"] = f"{minute} in the last minute; {notes['done']}"
    rows = [(st, s.shown(st), notes[st]) for st in ("pending", "processing", "dead", "done")]
    click.echo(text_table(["status", "messages", ""], rows, right=[1]))
    if any(s.capped.values()):
        click.echo(
            f"N+: at least N (each status is read up to {s.cap:,} index entries; "
            "the figures below count the rows read)"
        )
    click.echo("")


def _echo_facts(s: snapshot.Stats) -> None:
    """Ages, leases, ordered keys, groups and the xmin horizon, one labelled line each."""
    for label, value in _age_facts(s) + _group_facts(s) + _horizon_facts(s):
        click.echo(f"{label + ':':<46}{value}")
    click.echo("")


def _age_facts(s: snapshot.Stats) -> list[tuple[str, Any]]:
    fd = durations.format_duration
    return [
        ("oldest pending (since created)", fd(s.oldest_pending_age)),
        ("oldest ready wait (claimable, not claimed)", fd(s.oldest_ready_wait)),
        ("oldest processing (since created)", fd(s.oldest_processing_age)),
        ("expired leases", s.expired_leases),
        (
            "ordered keys blocked by a dead head",
            f"{s.blocked_keys} ({s.blocked_messages} message(s) waiting)",
        ),
        ("ordered keys without a head", s.headless_keys),
    ]


def _group_facts(s: snapshot.Stats) -> list[tuple[str, Any]]:
    g = s.groups
    return [
        (
            "open groups (oldest)",
            f"{g.open}{'+' if g.capped else ''} ({durations.format_duration(g.oldest_open_age)}), "
            f"{g.blocked} blocked by a dead member",
        ),
    ]


def _horizon_facts(s: snapshot.Stats) -> list[tuple[str, Any]]:
    h = s.horizon
    if h is None:
        return []
    fd = durations.format_duration
    return [
        ("xmin horizon held by", printable(h.holder())),
        (
            "dead row versions (table statistics)",
            f"{h.dead_row_versions:,} beside {h.live_row_versions:,} live; last vacuum "
            + (f"{fd(h.last_vacuum_age)} ago" if h.last_vacuum_age is not None else "never"),
        ),
    ]


def _echo_attempts(s: snapshot.Stats) -> None:
    if not s.attempts:
        return
    click.echo("attempts histogram (live messages)")
    click.echo(
        text_table(
            ["attempts", "pending", "processing", "dead"],
            [(a.attempts, a.pending, a.processing, a.dead) for a in s.attempts],
            right=[0, 1, 2, 3],
        )
    )
    click.echo("")


def _echo_event_types(s: snapshot.Stats, handlers: Collection[str] | None) -> None:
    """Live messages per event type (with -A, whether a handler takes it)."""
    if not s.event_types:
        click.echo("no live messages (nothing pending, processing or dead)")
        return
    fd = durations.format_duration
    headers = ["event type", "pending", "ready", "processing", "dead", "unstarted", "oldest pending"]
    if handlers is not None:
        headers.append("handler")
    rows: list[list[Any]] = []
    for e in s.event_types:
        r: list[Any] = [
            e.event_type,
            e.pending,
            e.ready,
            e.processing,
            e.dead,
            e.unstarted,
            fd(e.oldest_pending_age),
        ]
        if handlers is not None:
            r.append("yes" if e.has_handler else "NO")
        rows.append(r)
    click.echo(text_table(headers, rows, right=[1, 2, 3, 4, 5]))
    click.echo("")


def _echo_flow(s: snapshot.Stats) -> None:
    """Paused and held event types and limit keys: left unclaimed on purpose."""
    fd = durations.format_duration
    paused = [printable(f.event_type) for f in s.flow if f.paused]
    held = [
        f"{printable(f.event_type)} ({fd(f.held_for)} left)" for f in s.flow if not f.paused and f.held_for
    ]
    click.echo(f"paused (claimed by nobody until resumed): {', '.join(paused) or 'none'}")
    if held:
        click.echo(f"held by a RateLimited outcome: {', '.join(held)}")
    if s.keys:
        shown = [
            f"{printable(k.event_type)} key {printable(k.limit_key)} ("
            + ("paused" if k.paused else f"held, {fd(k.held_for)} left")
            + ")"
            for k in s.keys
        ]
        click.echo(f"limit keys claimed by nobody: {', '.join(shown)}")


def _echo_unroutable(s: snapshot.Stats) -> None:
    if s.unroutable is None:
        click.echo("unroutable: unknown (pass -A module:outbox to check event types against the handlers)")
    elif s.unroutable:
        click.echo(f"unroutable (pending, no handler): {', '.join(map(printable, s.unroutable))}")
    else:
        click.echo("unroutable: none")
