"""``outbox-celery groups``: groups with a callback listed, shown, finished or cancelled by hand
(DESIGN invariant 29)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import click

from ..ops import durations
from ..ops import groups as group_ops
from .main import Group, cli
from .options import pass_target
from .output import echo_json, printable, text_table
from .target import Target

__all__ = ["groups_"]


@cli.group("groups", cls=Group)
def groups_() -> None:
    """Groups with a callback: list, show, finish, cancel (DESIGN invariant 29)."""


def _group_rows(found: Sequence[group_ops.GroupInfo]) -> list[tuple[Any, ...]]:
    fd = durations.format_duration
    return [
        (g.id, g.state, g.progress, g.dead, printable(g.event_type), fd(g.age), g.callback_id or "-")
        for g in found
    ]


@groups_.command("list")
@click.option(
    "--state",
    type=click.Choice(["open", "fired", "skipped", "cancelled", "finished", "any"]),
    default="open",
    show_default=True,
)
@click.option("--limit", type=click.IntRange(1, 10000), default=50, show_default=True, help="The newest N.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_target
def groups_list(target: Target, state: str, limit: int, as_json: bool) -> None:
    """Groups and their progress (members final, of all), the newest first."""
    with target.connect() as conn:
        found = group_ops.list_groups(
            conn, target.table, state=None if state == "any" else state, limit=limit
        )
    if as_json:
        echo_json([dataclasses.asdict(g) for g in found])
        return
    headers = ["id", "state", "progress", "dead", "callback", "age", "callback id"]
    click.echo(text_table(headers, _group_rows(found), right=[0, 3]) if found else f"no {state} group")


@groups_.command("show")
@click.argument("group_id", metavar="ID", type=click.IntRange(1))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_target
def groups_show(target: Target, group_id: int, as_json: bool) -> None:
    """One group, and its dead members with their last errors (the first 100)."""
    with target.connect() as conn:
        g = group_ops.get_group(conn, target.table, group_id)
        dead = group_ops.group_outcomes(conn, target.table, group_id, limit=100)
    if as_json:
        echo_json({**dataclasses.asdict(g), "dead_members": [dataclasses.asdict(d) for d in dead]})
        return
    click.echo(
        text_table(["id", "state", "progress", "dead", "callback", "age", "callback id"], _group_rows([g]))
    )
    for d in dead:
        click.echo(f"dead member {d.id} ({printable(d.event_type)}): {printable(d.last_error or '-')}")
    if g.state == "open" and g.dead:
        click.echo(
            "fix: outbox-celery dead requeue ID | outbox-celery dead skip ID --reason '...' | "
            f"outbox-celery groups finish {g.id} --reason '...' | "
            f"outbox-celery groups cancel {g.id} --reason '...'"
        )


@groups_.command("finish")
@click.argument("group_id", metavar="ID", type=click.IntRange(1))
@click.option("--reason", required=True, help="Recorded with the group.")
@pass_target
def groups_finish(target: Target, group_id: int, reason: str) -> None:
    """Close an open group now and enqueue its callback with the outcomes so far."""
    with target.connect() as conn:
        callback = group_ops.finish_group(conn, target.table, group_id, reason=reason)
    click.echo(f"group {group_id} finished by hand; its callback is outbox id {callback}")


@groups_.command("cancel")
@click.argument("group_id", metavar="ID", type=click.IntRange(1))
@click.option("--reason", required=True, help="Recorded with the group.")
@pass_target
def groups_cancel(target: Target, group_id: int, reason: str) -> None:
    """Close an open group for good: its callback is never enqueued."""
    with target.connect() as conn:
        group_ops.cancel_group(conn, target.table, group_id, reason=reason)
    click.echo(f"group {group_id} cancelled; no callback will be enqueued")
