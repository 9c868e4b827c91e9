"""``outbox-celery dead``: dead letters listed, shown, requeued (deliver again) or skipped."""

from __future__ import annotations

import json
import textwrap

import click

from ..ops import dead as letters
from ..ops import durations
from .main import Group, cli
from .options import duration, message_ids, pass_target
from .output import echo_json, excerpt, printable, printable_lines, text_table
from .target import Target

__all__ = ["dead"]


@cli.group(cls=Group)
def dead() -> None:
    """Dead letters: list, show, requeue, skip."""


@dead.command("list")
@click.option("--event-type", help="Only this event type.")
@click.option("--aggregate-type", help="Only this aggregate type.")
@click.option("--aggregate-id", help="Only this aggregate id.")
@click.option(
    "--older-than",
    metavar="DURATION",
    callback=duration,
    help="Created more than this long ago (7d, 12h...).",
)
@click.option("--newer-than", metavar="DURATION", callback=duration, help="Created less than this long ago.")
@click.option("--limit", type=click.IntRange(1, 10000), default=50, show_default=True, help="Page size.")
@click.option("--after", type=click.IntRange(0), default=0, help="Page after this id (the last one shown).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_target
def dead_list(
    target: Target,
    event_type: str | None,
    aggregate_type: str | None,
    aggregate_id: str | None,
    older_than: float | None,
    newer_than: float | None,
    limit: int,
    after: int,
    as_json: bool,
) -> None:
    """Dead messages, oldest id first, with their last error."""
    filters: letters.DeadFilters = {
        "event_type": event_type,
        "aggregate_type": aggregate_type,
        "aggregate_id": aggregate_id,
        "older_than": older_than,
        "newer_than": newer_than,
    }
    with target.connect() as conn:
        rows = letters.list_dead(conn, target.table, after=after, limit=limit, **filters)
        total = letters.count_dead(conn, target.table, **filters)
    next_after = rows[-1].id if rows and len(rows) == limit else None
    if as_json:
        echo_json({"total": total, "messages": [r.as_dict() for r in rows], "next_after": next_after})
        return
    if not rows:
        if after and total:
            click.echo(f"no more dead messages after id {after} ({total} match)")
        elif any(v is not None for v in filters.values()):
            click.echo("no dead messages match these filters")
        else:
            click.echo("no dead messages")
        return
    click.echo(
        text_table(
            ["id", "event type", "aggregate", "attempts", "age", "blocks", "last error"],
            [
                (
                    r.id,
                    r.event_type,
                    printable(f"{r.aggregate_type}:{r.aggregate_id}"),
                    r.attempts,
                    durations.format_duration(r.age),
                    r.waiting_behind if r.ordering_key is not None else "-",
                    excerpt(r.last_error),
                )
                for r in rows
            ],
            right=[0, 3, 5],
        )
    )
    more = f"; next page: --after {next_after}" if next_after is not None else ""
    click.echo(f"{len(rows)} shown of {total} matching dead message(s){more}")


@dead.command("show")
@click.argument("outbox_id", metavar="ID", callback=message_ids)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_target
def dead_show(target: Target, outbox_id: int, as_json: bool) -> None:
    """One message (any status) and why it waits.

    Payload, attempts, lease, last error and, for an ordered message, its key's head.
    """
    with target.connect() as conn:
        row = letters.get_message(conn, target.table, outbox_id)
    if row is None:
        raise click.ClickException(f"no message with id {outbox_id} in {target.table.qualified}")
    if as_json:
        echo_json(row)
        return
    fd = durations.format_duration
    status = row["status"]
    lines = [
        ("id", row["id"]),
        ("status", status),
        ("event type", printable(row["event_type"])),
        ("aggregate", printable(f"{row['aggregate_type']}:{row['aggregate_id']}")),
        ("created", f"{row['created_at']:%Y-%m-%d %H:%M:%S %Z} ({fd(row['age'])} ago)"),
        ("attempts", row["attempts"]),
        ("lease version", row["lease_version"]),
    ]
    if status == "pending":
        wait = row["available_in"]
        lines.append(("available", f"in {fd(wait)}" if wait > 0 else f"now (due {fd(-wait)} ago)"))
    if status == "processing":
        exp = row["lease_expires_in"]
        lease = f"expires in {fd(exp)}" if exp is not None and exp > 0 else f"EXPIRED {fd(-(exp or 0))} ago"
        lines.append(("lease", f"{lease}, owner {printable(row['lease_owner'] or '-')}"))
    unstarted = int(row.get("unstarted_claims") or 0)
    if status in ("pending", "processing") and unstarted:
        # Claims whose task no worker started (DESIGN invariants 10, 16): a live lease's own
        # claim may still start; more than that means tasks were lost.
        lines.append(("unstarted", f"{unstarted} claim(s) since a worker last started it"))
    if row["done_at"] is not None:
        lines.append(("done at", f"{row['done_at']:%Y-%m-%d %H:%M:%S %Z}"))
    if row["ordering_key"] is not None:
        head = row["key_head"]
        if head is None and (status != "done" or row["waiting_behind"]):
            position = "no message of the key is its head: none is claimed (outbox-celery repair-heads)"
        elif head is None:
            position = "every message of the key is done"
        elif head == row["id"]:
            position = f"head of its key; {row['waiting_behind']} message(s) wait behind it"
        else:
            position = f"waits behind id {head}, the head of its key"
        lines.append(("ordering key", f"{printable(row['ordering_key'])} ({position})"))
    for label, value in lines:
        click.echo(f"{label + ':':<15}{value}")
    click.echo("payload:")
    click.echo(printable_lines(json.dumps(row["payload"], indent=2, ensure_ascii=False)))
    click.echo("last error:")
    click.echo(printable_lines(row["last_error"] or "-"))
    # Every failed attempt's own error, the last 20 (DESIGN invariant 32).
    attempts = letters.failed_attempts(row["errors"])
    click.echo("failed attempts (the latest first):" if attempts else "failed attempts: none recorded")
    for a in attempts:
        click.echo(f"  attempt {a.attempt} at {a.at:%Y-%m-%d %H:%M:%S %Z}:")
        click.echo(textwrap.indent(printable_lines(a.error), "    "))
    expired = status == "processing" and (row["lease_expires_in"] or 0) <= 0
    if status == "dead" or expired:
        click.echo("")
        click.echo(
            f"fix: outbox-celery dead requeue {row['id']}   |   "
            f"outbox-celery dead skip {row['id']} --reason '...'"
        )


@dead.command("requeue")
@click.argument("ids", metavar="[ID]...", nargs=-1, callback=message_ids)
@click.option("--all", "all_", is_flag=True, help="Every dead message (narrow with --event-type).")
@click.option("--event-type", help="With --all: only dead messages of this event type.")
@click.option("--reason", help="Recorded in last_error.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_target
def dead_requeue(
    target: Target,
    ids: tuple[int, ...],
    all_: bool,
    event_type: str | None,
    reason: str | None,
    as_json: bool,
) -> None:
    """Deliver again: back to pending now, attempts reset.

    The old error is kept in last_error behind a prefix. Processing messages whose lease
    expired (lost task, removed handler) can be requeued by id; live leases are refused.

    Give ids, or --all. Unknown or not-dead ids refuse the whole command.
    """
    if ids and all_:
        raise click.ClickException("give message ids or --all, not both")
    if not ids and not all_:
        raise click.ClickException("nothing to requeue: give message ids or --all")
    if event_type is not None and not all_:
        raise click.ClickException("--event-type filters --all; with ids it is not needed")
    with target.connect() as conn:
        if all_:
            n = letters.requeue_all(conn, target.table, event_type=event_type, reason=reason)
            changed: list[int] | None = None
        else:
            changed = letters.requeue(conn, target.table, ids, reason=reason)
            n = len(changed)
    if as_json:
        echo_json({"requeued": n, "ids": changed})
        return
    scope = f" of event type {printable(event_type)}" if event_type else ""
    listed = f": {', '.join(map(str, changed))}" if changed else ""
    click.echo(f"requeued {n} dead message(s){scope}{listed}")


@dead.command("skip")
@click.argument("ids", metavar="ID...", nargs=-1, callback=message_ids)
@click.option("--reason", help="Why it is skipped (required; recorded in last_error).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_target
def dead_skip(target: Target, ids: tuple[int, ...], reason: str | None, as_json: bool) -> None:
    """Never deliver: mark dead (or pending) messages done.

    Unblocks an ordered key whose head can never be delivered. The reason is recorded.
    Processing messages whose lease expired can be skipped; live leases are refused.
    """
    if not ids:
        raise click.ClickException("nothing to skip: give message ids")
    if reason is None or not reason.strip():
        raise click.ClickException("skip needs --reason TEXT (it is recorded in last_error)")
    with target.connect() as conn:
        changed = letters.skip(conn, target.table, ids, reason=reason)
    if as_json:
        echo_json({"skipped": len(changed), "ids": changed})
        return
    click.echo(f"skipped {len(changed)} message(s): {', '.join(map(str, changed))}")
