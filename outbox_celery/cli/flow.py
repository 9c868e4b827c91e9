"""``outbox-celery pause`` and ``resume``: event types and limit keys held back by hand
(docs/flow-control.md)."""

from __future__ import annotations

import difflib
from collections.abc import Collection, Sequence

import click

from ..message import split_route
from ..ops import flow as flows
from .main import cli
from .options import pass_target
from .output import echo_json, printable
from .target import Target

__all__ = ["pause", "resume"]


def _close(word: str, candidates: Collection[str]) -> str | None:
    """The candidate closest to ``word`` (a likely typo's intended spelling), if any is close."""
    found = difflib.get_close_matches(word, sorted(candidates), n=1, cutoff=0.6)
    return found[0] if found else None


def _require_handler(target: Target, event_type: str) -> None:
    """Refuse an event type the loaded Outbox has no handler for (a typo, most likely).

    Without ``-A`` the handlers are unknown and any event type is accepted: an event type can
    be paused before its first message or its handler's deploy.
    """
    handlers = target.handlers
    if handlers is None or event_type in handlers:
        return
    if any(split_route(h)[0] == event_type for h in handlers):
        return  # an event type with subscriptions: pause and resume reach each of its routes
    close = _close(event_type, handlers)
    if close is not None:
        hint = f"; did you mean {close!r}?"
    elif handlers:
        hint = f"; its handlers: {', '.join(printable(h) for h in sorted(handlers))}"
    else:
        hint = "; it has no handlers"
    raise click.ClickException(f"the loaded Outbox has no handler for event type {event_type!r}{hint}")


def _flow_what(event_type: str, limit_key: str | None, routes: Sequence[str] = ()) -> str:
    """``'type'`` or ``'type' key 'key'``, quoted and escaped (operator- and producer-supplied),
    with the routes of the type's subscriptions that the action reached (DESIGN invariant 28)."""
    what = f"{event_type!r}" if limit_key is None else f"{event_type!r} key {limit_key!r}"
    if routes:
        what += f" with its subscriptions {', '.join(map(repr, routes))}"
    return what


def _echo_flow_json(
    event_type: str, limit_key: str | None, routes: Sequence[str], *, paused: bool, changed: bool
) -> None:
    """``pause`` and ``resume``'s ``--json`` output."""
    echo_json(
        {
            "event_type": event_type,
            "limit_key": limit_key,
            "routes": routes,
            "paused": paused,
            "changed": changed,
        }
    )


@cli.command()
@click.argument("event_type")
@click.option("--key", "limit_key", default=None, help="Only this limit key of EVENT_TYPE.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_target
def pause(target: Target, event_type: str, limit_key: str | None, as_json: bool) -> None:
    """Pause EVENT_TYPE: no worker is handed its messages until `resume` (running ones finish).

    The pause lives in the database (the table's flow-control rows, migration 0007): every
    claim, on every worker, respects it from its next run on. `stats` lists paused event types.
    With --key, only that limit key of the type is paused (migration 0008); its other keys flow.
    An event type with subscriptions is paused with every route of it (order.paid pauses
    order.paid@receipt and its other subscriptions; resume order.paid resumes them all); a
    route pauses that subscription alone. With -A, an event type the Outbox has no handler
    for is refused (exit 1) with the closest handled type.
    """
    _require_handler(target, event_type)
    with target.connect() as conn:
        changed = flows.pause(conn, target.table, event_type, limit_key=limit_key)
        routes = flows.flow_targets(conn, target.table, event_type)[1:]
    what = _flow_what(event_type, limit_key, routes)
    if as_json:
        _echo_flow_json(event_type, limit_key, routes, paused=True, changed=changed)
    elif changed:
        click.echo(f"paused {what}: its messages are claimed by nobody until resumed")
    else:
        click.echo(f"{what} was already paused: nothing changed")


@cli.command()
@click.argument("event_type")
@click.option("--key", "limit_key", default=None, help="Only this limit key of EVENT_TYPE.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_target
def resume(target: Target, event_type: str, limit_key: str | None, as_json: bool) -> None:
    """Resume EVENT_TYPE: claimable at once (push listeners are woken); ends a RateLimited hold too.

    With --key, only that limit key of the type (its pause or its RateLimited hold). A type
    (or key) that was neither paused nor held changes nothing: the output says so and names
    the closest one that is paused, if any. With -A, such a type that the Outbox has no handler
    for is refused (exit 1).
    """
    with target.connect() as conn:
        changed = flows.resume(conn, target.table, event_type, limit_key=limit_key)
        routes = flows.flow_targets(conn, target.table, event_type)[1:]
        held: list[str] = []
        if not changed:
            if limit_key is None:
                held = [f.event_type for f in flows.flow_states(conn, target.table)]
            else:
                held = [
                    k.limit_key for k in flows.key_states(conn, target.table) if k.event_type == event_type
                ]
    what = _flow_what(event_type, limit_key, routes)
    close = None
    if not changed:
        if limit_key is None:
            _require_handler(target, event_type)
            close = _close(event_type, held)
        else:
            found = _close(limit_key, held)
            close = None if found is None else _flow_what(event_type, found)
    if as_json:
        _echo_flow_json(event_type, limit_key, routes, paused=False, changed=changed)
    elif changed:
        click.echo(f"resumed {what}: its messages are claimable now")
    else:
        hint = "" if close is None else f"; did you mean {close if limit_key is not None else repr(close)}?"
        click.echo(f"{what} was not paused or held: nothing changed{hint}")
