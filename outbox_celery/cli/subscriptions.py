"""``outbox-celery subscriptions``: the named handlers producers fan events out to (DESIGN
invariant 28), listed, added (optionally replaying history) and removed."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

import click
import psycopg

from ..message import route as route_of
from ..ops import durations, retention, subscriptions
from ..table import TableName
from .main import Group, cli
from .options import pass_target
from .output import echo_json, printable, text_table
from .target import Target

__all__ = ["declared_lines", "subscriptions_group"]


@cli.group("subscriptions", cls=Group)
def subscriptions_group() -> None:
    """List, add and remove the subscriptions the producers fan events out to (DESIGN invariant 28).

    A subscription is a named handler of an event type (@outbox.handler("order.paid",
    name="receipt")); its messages carry the route order.paid@receipt wherever an event type is
    shown or given (stats, dead, pause, resume, metrics). Workers add their handlers'
    subscriptions at start-up; `subscriptions sync -A` (or `migrate -A`) adds them at a deploy
    step, before producers run.
    """


def declared_lines(found: list[subscriptions.Declared]) -> list[str]:
    """One line per subscription an app declares, saying what the table holds of it."""
    if not found:
        return ["the app declares no subscriptions"]
    lines = []
    for d in found:
        route = printable(d.route)
        if d.state == "removed":
            lines.append(
                f"subscription {route} was removed by an operator: left removed "
                f"(outbox-celery subscriptions add {printable(d.event_type)} {printable(d.name)} "
                "brings it back)"
            )
        elif d.state == "missing":
            lines.append(f"subscription {route} is missing (outbox-celery migrate -A adds it)")
        else:
            lines.append(f"subscription {route} {d.state}")
    return lines


def _since(conn: psycopg.Connection[Any], table: TableName, text: str) -> datetime:
    """A duration back from the database's now() (``7d``) or an ISO time (``2026-12-01T00:00Z``)."""
    try:
        back = durations.parse_duration(text)
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
    click.echo(_table(found, "created", lambda s: f"{s.created_at:%Y-%m-%d %H:%M:%S}", set()))


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
    """Add subscription NAME of EVENT_TYPE: it receives the events written after this commits.

    One that is live already is left as it is ("exists", exit 0); a removed one comes back.
    """
    with target.connect() as conn:
        since = _since(conn, target.table, replay_since) if replay_since else None
        done = subscriptions.add(conn, target.table, event_type, name, replay_since=since)
    if as_json:
        echo_json({"route": done.route, "added": done.added, "replayed": done.replayed})
        return
    what = "added" if done.added else "exists: nothing changed"
    replayed = f"; {done.replayed} event(s) replayed" if since else ""
    click.echo(f"subscription {printable(done.route)} {what}{replayed}")


@subscriptions_group.command("sync")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_target
def subscriptions_sync(target: Target, as_json: bool) -> None:
    """Add the subscriptions the app (-A) declares, then list every subscription of the table.

    A deploy step, idempotent: run it before the producers of a release that adds a
    subscription, so no event written meanwhile misses it. Each subscription is shown declared
    by the app or not, live or removed; one an operator removed stays removed, and none is
    removed here.
    """
    outbox = target.outbox
    if outbox is None:
        raise click.ClickException(
            "subscriptions sync adds the subscriptions an app declares: pass -A module:outbox"
        )
    with target.connect() as conn:
        found = subscriptions.declare(conn, target.table, outbox.handlers)
        listed = subscriptions.list_subscriptions(conn, target.table)
    states = {d.route: d.state for d in found}
    if as_json:
        echo_json(
            {
                "declared": [{"route": d.route, "state": d.state} for d in found],
                "subscriptions": [{**s.as_dict(), "declared": s.route in states} for s in listed],
            }
        )
        return
    counts = {state: sum(d.state == state for d in found) for state in ("added", "exists", "removed")}
    if found:
        click.echo(
            f"{len(found)} subscription(s) declared by the app: {counts['added']} added, "
            f"{counts['exists']} existed, {counts['removed']} removed by an operator (left removed)"
        )
    else:
        click.echo("the app declares no subscriptions")
    if not listed:
        click.echo("no subscriptions")
        return
    added = {route for route, state in states.items() if state == "added"}
    click.echo(_table(listed, "declared", lambda s: "yes" if s.route in states else "no", added))
    for s in listed:
        route = printable(s.route)
        if s.route in states and s.removed_at is not None:
            click.echo(
                f"{route}: declared by the app, removed by an operator: outbox-celery subscriptions "
                f"add {printable(s.event_type)} {printable(s.name)} brings it back"
            )
        elif s.route not in states and s.removed_at is None:
            click.echo(f"{route}: live, not declared by the app: its events wait for its handler")


def _table(
    found: list[subscriptions.Subscription],
    column: str,
    cell: Callable[[subscriptions.Subscription], str],
    added: set[str],
) -> str:
    """The subscriptions as a table: route, ``column`` (``cell`` of each), state (``added`` for
    the routes in ``added``, else live or removed) and unfinished rows."""

    def state(s: subscriptions.Subscription) -> str:
        if s.removed_at is not None:
            return f"removed {s.removed_at:%Y-%m-%d %H:%M:%S}"
        return "added" if s.route in added else "live"

    rows = [(printable(s.route), cell(s), state(s), s.pending, s.processing, s.dead) for s in found]
    return text_table(["route", column, "state", "pending", "processing", "dead"], rows, right=[3, 4, 5])


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
