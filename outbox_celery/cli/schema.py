"""``outbox-celery migrate``: the table's schema, created or brought up to date."""

from __future__ import annotations

import click

from ..db import migrations
from .main import cli
from .options import pass_target
from .output import echo_json
from .target import Target

__all__ = ["migrate"]


@cli.command()
@click.option("--check", is_flag=True, help="Change nothing; exit 1 when migrations are pending.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_target
def migrate(target: Target, check: bool, as_json: bool) -> None:
    """Create or upgrade the outbox table (idempotent)."""
    table = target.table
    with target.connect() as conn:
        if check:
            todo = migrations.pending(conn, table)
            current = migrations.applied_versions(conn, table)
            if as_json:
                echo_json(
                    {
                        "table": table.qualified,
                        "up_to_date": not todo,
                        "applied": current,
                        "pending": [m.version for m in todo],
                    }
                )
            elif todo:
                names = ", ".join(f"{m.version:04d}_{m.name}" for m in todo)
                click.echo(f"schema of {table.qualified} is behind: pending {names}")
            else:
                click.echo(f"schema of {table.qualified} is up to date (version {max(current)})")
            if todo:
                raise SystemExit(1)
            return
        applied = migrations.migrate(conn, table)
        current = migrations.applied_versions(conn, table)
    if as_json:
        echo_json({"table": table.qualified, "applied_now": applied, "applied": current})
    elif applied:
        click.echo(
            f"migrated {table.qualified}: applied version(s) {', '.join(map(str, applied))}; "
            f"now at version {max(current)}"
        )
    else:
        click.echo(f"{table.qualified} is already up to date (version {max(current)})")
