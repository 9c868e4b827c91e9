"""``outbox-celery web``: the operator console in the browser (docs/console.md)."""

from __future__ import annotations

import click

from ..errors import first_line
from .main import cli
from .options import pass_target_object
from .target import Target

__all__ = ["web"]


@cli.command()
@click.option(
    "--dsn",
    "dsns",
    multiple=True,
    metavar="[NAME=]DSN",
    help="A database to show (repeat for several, side by side); NAME=postgresql://... names it. "
    "Default: the group's --dsn or OUTBOX_DSN.",
)
@click.option("--table", default=None, metavar="NAME", help="Outbox table (the same in every database).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8808, show_default=True, help="HTTP port.")
@click.option(
    "--actions", is_flag=True, help="Allow replay, skip, pause and resume (needs --token or --basic-auth)."
)
@click.option(
    "--token",
    envvar="OUTBOX_WEB_TOKEN",
    default=None,
    help="A token every request must carry (env OUTBOX_WEB_TOKEN).",
)
@click.option(
    "--basic-auth",
    envvar="OUTBOX_WEB_BASIC_AUTH",
    default=None,
    metavar="USER:PASSWORD",
    help="HTTP basic auth every request must carry (env OUTBOX_WEB_BASIC_AUTH).",
)
@click.option(
    "--flower-url", envvar="OUTBOX_FLOWER_URL", default=None, help="Link Celery task ids to this Flower."
)
@pass_target_object
def web(
    target: Target,
    dsns: tuple[str, ...],
    table: str | None,
    host: str,
    port: int,
    actions: bool,
    token: str | None,
    basic_auth: str | None,
    flower_url: str | None,
) -> None:
    """The operator console in the browser: serve http://HOST:PORT/ until stopped (docs/console.md)."""
    try:
        from ..web.serve import databases_from, serve
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise click.ClickException(
            f"{first_line(exc)}: install the web extra (pip install 'outbox-celery[web]')"
        ) from None
    if table is not None:
        target.override(table=table)
    given = list(dsns) or [target.dsn]
    try:
        dbs = databases_from(given, table=str(target.table), outbox=target.outbox)
    except ValueError as exc:
        raise click.ClickException(target.scrub(str(exc))) from None
    auth: tuple[str, str] | None = None
    if basic_auth is not None:
        user, sep, pw = basic_auth.partition(":")
        if not sep or not user or not pw:
            raise click.ClickException("--basic-auth takes USER:PASSWORD")
        auth = (user, pw)
    if actions and token is None and auth is None:
        raise click.ClickException(
            "--actions needs --token or --basic-auth: a console that can replay messages needs a login"
        )
    serve(dbs, host=host, port=port, actions=actions, token=token, basic_auth=auth, flower_url=flower_url)
