"""``outbox-celery subscriptions``: the named handlers producers fan events out to (DESIGN
invariant 28), listed, added (optionally replaying history) and removed."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import click
import psycopg

from .. import ops
from ..config import TableName
from ..message import route as route_of
from ..ops import retention, subscriptions
from .main import Group, cli
from .options import pass_target
from .output import echo_json, printable, text_table
from .target import Target

__all__ = ["subscriptions_group"]


@cli.group("subscriptions", cls=Group)
def subscriptions_group() -> None:
    """List, add and remove the subscriptions the producers fan events out to (DESIGN invariant 28).

    A subscription is a named handler of an event type (@outbox.handler("order.paid",
    name="receipt")); its messages carry the route order.paid@receipt wherever an event type is
    shown or given (stats, dead, pause, resume, metrics). Workers add their handlers'
    subscriptions at start-up.
    """


def _since(conn: psycopg.Connection[Any], table: TableName, text: str) -> datetime:
    """A duration back from the database's now() (``7d``) or an ISO time (``2026-12-01T00:00Z``)."""
    try:
        back = ops.parse_duration(text)
    except ValueError:
        try:
            return datetime.fromisoformat(text)
        except ValueError:
            raise click.ClickException(
                f"--replay-since {text!r}: give a duration back from now (7d, 12h) or an ISO time"
            ) from None
    return retention.cutoff(conn, table, back)


@subscriptions_group.command("list")
@click.option("--event-type", help="Only this event type.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_target
def subscriptions_list(target: Target, event_type: str | None, as_json: bool) -> None:
    """Every subscription (removed ones too) with its unfinished messages."""
    with target.connect() as conn:
        found = subscriptions.list_subscriptions(conn, target.table, event_type=event_type)
    if as_json:
        echo_json([s.as_dict() for s in found])
        return
    if not found:
        click.echo("no subscriptions")
        return
    rows = [
        (
            printable(s.route),
            f"{s.created_at:%Y-%m-%d %H:%M:%S}",
            f"removed {s.removed_at:%Y-%m-%d %H:%M:%S}" if s.removed_at else "live",
            s.pending,
            s.processing,
            s.dead,
        )
        for s in found
    ]
    click.echo(
        text_table(["route", "created", "state", "pending", "processing", "dead"], rows, right=[3, 4, 5])
    )


@subscriptions_group.command("add")
@click.argument("event_type")
@click.argument("name")
@click.option(
    "--replay-since",
    metavar="WHEN",
    help="First replay the retained events of EVENT_TYPE from WHEN (7d, or an ISO time), in batches.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_target
def subscriptions_add(
    target: Target, event_type: str, name: str, replay_since: str | None, as_json: bool
) -> None:
    """Add subscription NAME of EVENT_TYPE: it receives the events written after this commits."""
    with target.connect() as conn:
        since = _since(conn, target.table, replay_since) if replay_since else None
        replayed = subscriptions.add(conn, target.table, event_type, name, replay_since=since)
    route = route_of(event_type, name)
    if as_json:
        echo_json({"route": route, "replayed": replayed})
    else:
        click.echo(
            f"subscription {printable(route)} added" + (f"; {replayed} event(s) replayed" if since else "")
        )


@subscriptions_group.command("remove")
@click.argument("event_type")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_target
def subscriptions_remove(target: Target, event_type: str, name: str, as_json: bool) -> None:
    """Remove subscription NAME of EVENT_TYPE: producers stop fanning out to it at once.

    Its undelivered messages stay as they are, visible under its route (stats, dead list,
    subscriptions list); skip or purge them deliberately.
    """
    with target.connect() as conn:
        changed = subscriptions.remove(conn, target.table, event_type, name)
    route = route_of(event_type, name)
    if as_json:
        echo_json({"route": route, "removed": changed})
    elif changed:
        click.echo(f"subscription {printable(route)} removed: new events no longer go to it")
    else:
        click.echo(f"{printable(route)} is not a live subscription: nothing changed")
