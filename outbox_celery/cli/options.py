"""The options and arguments commands share: durations, message ids, and the target's
``--dsn``/``--table``/``-A`` after the command."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from ..ops import durations
from .target import Target

__all__ = ["duration", "message_ids", "pass_target", "pass_target_object"]


def duration(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    """Option callback: ``7d``, ``12h``, ``30m``, ``45s``, ``1w``, ``1h30m`` -> seconds."""
    if value is None:
        return None
    try:
        return durations.parse_duration(value)
    except ValueError as exc:
        raise click.ClickException(f"{param.opts[0]}: {exc}") from None


def _message_id(value: str) -> int:
    try:
        n = int(value, 10)
    except ValueError:
        n = 0
    if n < 1:
        raise click.ClickException(f"invalid message id {value!r}: expected a positive integer")
    return n


def message_ids(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """Argument callback: one id or a tuple of ids, each a positive integer."""
    if isinstance(value, tuple):
        return tuple(_message_id(v) for v in value)
    return _message_id(value)


pass_target_object = click.make_pass_decorator(Target)


def _override_target(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """Option callback: ``--dsn``/``--table``/``-A`` given after the command beat the group's."""
    if value is None:
        return
    target = ctx.find_object(Target)
    if target is not None:
        target.override(**{str(param.name): value})


def pass_target(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Pass the :class:`Target` and accept ``--dsn``/``--table``/``-A`` after the command too.

    ``outbox-celery migrate --dsn ...`` is how most people type it (and how the README shows
    it); the group's options (before the command) and the environment keep working.
    """
    fn = pass_target_object(fn)
    fn = click.option(
        "-A",
        "--app",
        "app_spec",
        metavar="MODULE[:ATTR]",
        expose_value=False,
        callback=_override_target,
        help="Load an Outbox (e.g. proj.tasks:outbox); same as the option before the command.",
    )(fn)
    for name, what in (
        ("--database", "Which database of an Outbox that serves several"),
        ("--table", "Outbox table"),
        ("--dsn", "PostgreSQL connection string"),
    ):
        fn = click.option(
            name,
            metavar=name.lstrip("-").upper() if name == "--dsn" else "NAME",
            expose_value=False,
            callback=_override_target,
            help=f"{what}; same as the option before the command.",
        )(fn)
    return fn
