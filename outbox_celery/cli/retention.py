"""``outbox-celery purge`` and ``repair-heads``: done rows deleted, ordering keys mended."""

from __future__ import annotations

import click

from ..ops import durations, heads, retention
from .main import cli
from .options import duration, pass_target
from .output import echo_json
from .target import Target

__all__ = ["purge", "repair_heads"]


@cli.command()
@click.option(
    "--older-than",
    metavar="DURATION",
    callback=duration,
    required=True,
    help="Age of done rows to delete (7d, 12h...).",
)
@click.option(
    "--batch-size",
    type=click.IntRange(1, 100_000),
    default=5000,
    show_default=True,
    help="Rows per delete; each batch is its own short transaction.",
)
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_target
def purge(target: Target, older_than: float, batch_size: int, dry_run: bool, as_json: bool) -> None:
    """Delete old done rows, in short batches (never any other status)."""
    age = durations.format_duration(older_than)
    with target.connect() as conn:
        if dry_run:
            n = retention.count_purgeable(conn, target.table, older_than=older_than)
        else:
            n = retention.purge_done(conn, target.table, older_than=older_than, batch_size=batch_size)
    if as_json:
        echo_json(
            {
                "dry_run": dry_run,
                "older_than_seconds": older_than,
                ("would_delete" if dry_run else "deleted"): n,
            }
        )
    elif dry_run:
        click.echo(f"dry run: would delete {n} done message(s) older than {age}")
    else:
        click.echo(f"deleted {n} done message(s) older than {age}")


@cli.command("repair-heads")
@click.option(
    "--batch-size", type=click.IntRange(min=1), default=500, show_default=True, help="Keys per transaction."
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_target
def repair_heads(target: Target, batch_size: int, as_json: bool) -> None:
    """Give ordering keys that lost their head (stats: "without a head") their head back.

    A producer or worker of a release before migration 0004 that kept running after it leaves
    such keys; their messages are never claimed until this runs. Safe while producers and
    workers run (it takes the producers' key locks); a second run mends nothing.
    """
    with target.connect() as conn:
        keys = heads.repair_heads(conn, target.table, batch_size=batch_size)
    if as_json:
        echo_json({"repaired": len(keys), "keys": keys})
    else:
        click.echo(f"repaired {len(keys)} ordering key(s) without a head")
