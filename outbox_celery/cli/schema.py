"""``outbox-celery migrate``: the table's schema, created or brought up to date."""

from __future__ import annotations

from typing import Any

import click

from ..db import migrations
from ..ops import subscriptions
from .main import cli
from .options import pass_target
from .output import echo_json
from .subscriptions import declared_lines
from .target import Target

__all__ = ["migrate"]


@cli.command()
@click.option("--check", is_flag=True, help="Change nothing; exit 1 when migrations are pending.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_target
def migrate(target: Target, check: bool, as_json: bool) -> None:
    """Create or upgrade the outbox table (idempotent).

    With -A, also add the subscriptions the app's handlers declare and say, for each, whether
    it was added or existed (as `subscriptions sync`): a deploy step run before the producers.
    With --check, exit 1 as well when one of them is missing. An Outbox that serves several
    databases has each migrated in turn, unless --database names one.
    """
    names = target.database_names if target.database is None else []
    if not names:
        failed = _migrate_one(target, check, as_json)
    else:
        # An Outbox of several databases: each one, in turn (DESIGN invariant 34).
        results: list[dict[str, Any]] = []
        failed = False
        for name in names:
            target.override(database=name)
            if not as_json:
                click.echo(f"database {name}:")
            failed = _migrate_one(target, check, as_json, into=results) or failed
        if as_json:
            echo_json({"databases": results})
    if failed:
        raise SystemExit(1)


def _migrate_one(
    target: Target, check: bool, as_json: bool, into: list[dict[str, Any]] | None = None
) -> bool:
    """Migrate (or check) the target's database; whether ``--check`` found something to do.

    With ``into``, the JSON result is appended there (with the database's name) instead of printed.
    """
    table = target.table
    outbox = target.outbox
    routes = list(outbox.handlers) if outbox is not None else None
    declared: list[subscriptions.Declared] | None = None

    def emit(result: dict[str, Any]) -> None:
        if into is None:
            echo_json(result)
        else:
            into.append({"database": target.database, **result})

    with target.connect() as conn:
        if check:
            todo = migrations.pending(conn, table)
            current = migrations.applied_versions(conn, table)
            if routes is not None:
                declared = subscriptions.declared(conn, table, routes)
            missing = [d for d in declared or [] if d.state == "missing"]
            if as_json:
                emit(
                    {
                        "table": table.qualified,
                        "up_to_date": not todo,
                        "applied": current,
                        "pending": [m.version for m in todo],
                        **_declared_json(declared),
                    }
                )
            else:
                if todo:
                    names = ", ".join(f"{m.version:04d}_{m.name}" for m in todo)
                    click.echo(f"schema of {table.qualified} is behind: pending {names}")
                else:
                    click.echo(f"schema of {table.qualified} is up to date (version {max(current)})")
                _echo_declared(declared)
            return bool(todo or missing)
        applied = migrations.migrate(conn, table)
        current = migrations.applied_versions(conn, table)
        if routes is not None:
            declared = subscriptions.declare(conn, table, routes)
    if as_json:
        emit(
            {"table": table.qualified, "applied_now": applied, "applied": current, **_declared_json(declared)}
        )
        return False
    if applied:
        click.echo(
            f"migrated {table.qualified}: applied version(s) {', '.join(map(str, applied))}; "
            f"now at version {max(current)}"
        )
    else:
        click.echo(f"{table.qualified} is already up to date (version {max(current)})")
    _echo_declared(declared)
    return False


def _declared_json(declared: list[subscriptions.Declared] | None) -> dict[str, Any]:
    """The ``subscriptions`` key of ``--json`` with -A; nothing without."""
    if declared is None:
        return {}
    return {"subscriptions": [{"route": d.route, "state": d.state} for d in declared]}


def _echo_declared(declared: list[subscriptions.Declared] | None) -> None:
    if declared is not None:
        for line in declared_lines(declared):
            click.echo(line)
