"""The root of the command line: the ``outbox-celery`` group, its ``celery outbox`` twin, and
the error handling every command shares.

The commands are defined on :data:`cli` by the modules of this package, one per command group
(:mod:`outbox_celery.cli` imports them all); ``celery outbox`` shares the same command table.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

import click
import psycopg

from ..errors import OutboxError, first_line
from .discovery import celery_outbox_finder
from .target import Target

__all__ = ["Group", "celery_outbox", "cli", "main"]


class Group(click.Group):
    """Turns library and database errors into one-line ``Error:`` messages (exit 1)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (OutboxError, psycopg.Error) as exc:
            message = first_line(exc)
            if isinstance(exc, psycopg.errors.UndefinedTable):
                message += "; is the schema installed? run `outbox-celery migrate`"
            target = ctx.find_object(Target)
            if target is not None:
                message = target.scrub(message)
            raise click.ClickException(message) from None


# -- the group ---------------------------------------------------------------------------------

_TARGET_OPTIONS = [
    click.option(
        "--dsn",
        envvar="OUTBOX_DSN",
        metavar="DSN",
        help="PostgreSQL connection string (env OUTBOX_DSN). Default: the loaded Outbox's dsn.",
    ),
    click.option(
        "--table",
        envvar="OUTBOX_TABLE",
        metavar="NAME",
        help="Outbox table, 'name' or 'schema.name' (env OUTBOX_TABLE). Default: the Outbox's, or outbox.",
    ),
    click.option(
        "--database",
        envvar="OUTBOX_DATABASE",
        metavar="NAME",
        help="Which database of an Outbox that serves several (env OUTBOX_DATABASE; docs/databases.md).",
    ),
]


def _target_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(_TARGET_OPTIONS):
        fn = option(fn)
    return fn


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@_target_options
@click.option(
    "-A",
    "--app",
    "app_spec",
    envvar="OUTBOX_APP",
    metavar="MODULE[:ATTR]",
    help="Load an Outbox (e.g. proj.tasks:outbox) for its dsn, table and handlers (env OUTBOX_APP).",
)
@click.option("-v", "--verbose", is_flag=True, help="Show the library's log records on stderr.")
@click.version_option(package_name="outbox-celery", prog_name="outbox-celery")
@click.pass_context
def cli(
    ctx: click.Context,
    dsn: str | None,
    table: str | None,
    database: str | None,
    app_spec: str | None,
    verbose: bool,
) -> None:
    """See, steer and maintain a transactional outbox (PostgreSQL + Celery)."""
    _setup_logging(verbose)
    ctx.obj = Target(
        dsn=dsn, table=table, app_spec=app_spec, database=database, dsn_from_env=_from_env(ctx, "dsn")
    )


def _from_env(ctx: click.Context, name: str) -> bool:
    """Whether option ``name`` was read from its environment variable."""
    return ctx.get_parameter_source(name) == click.core.ParameterSource.ENVIRONMENT


def _setup_logging(verbose: bool) -> None:
    """Commands print their own one-line results; library records only with --verbose.

    Without a handler Python's last-resort handler would print the library's warnings (an
    operator's requeue, say) a second time on stderr.
    """
    root = logging.getLogger("outbox_celery")
    if verbose:
        handler: logging.Handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.setLevel(logging.INFO)
    else:
        handler = logging.NullHandler()
    root.addHandler(handler)


# -- entry points ------------------------------------------------------------------------------


@click.group("outbox", cls=Group)
@_target_options
@click.option(
    "--outbox", "outbox_name", metavar="NAME", help="Which Outbox of the app (by name) when it has several."
)
@click.pass_context
def celery_outbox(
    ctx: click.Context, dsn: str | None, table: str | None, database: str | None, outbox_name: str | None
) -> None:
    """Operate the app's transactional outbox (same commands as outbox-celery)."""
    _setup_logging(False)
    ctx.obj = Target(
        dsn=dsn,
        table=table,
        outbox_finder=celery_outbox_finder(ctx, outbox_name),
        database=database,
        dsn_from_env=_from_env(ctx, "dsn"),
    )


# One command table for both entry points: a command defined on ``cli`` anywhere, before or after
# this line, is also a ``celery outbox`` command.
celery_outbox.commands = cli.commands


def main(argv: Sequence[str] | None = None) -> None:
    """Run the CLI (the ``outbox-celery`` console script and ``python -m outbox_celery``)."""
    cli.main(args=list(argv) if argv is not None else None)
