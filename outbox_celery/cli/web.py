"""``outbox-celery web``: the operator console in the browser (docs/console.md)."""

from __future__ import annotations

import contextlib
import re
import signal
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

import click
from psycopg.conninfo import conninfo_to_dict

from ..dsn import redact
from ..errors import first_line
from .main import cli
from .options import pass_target_object
from .target import Target

if TYPE_CHECKING:
    from ..web.app import Database

__all__ = ["databases_from", "serve", "web"]


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
        from ..web import app  # noqa: F401 - the web extra, checked before anything runs
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


_NAMED = re.compile(r"^([A-Za-z0-9_.-]+)=((?:postgres|postgresql)://.*)$", re.DOTALL)


def databases_from(values: Sequence[str], *, table: str, outbox: Any = None) -> list[Database]:
    """``[NAME=]DSN`` values as :class:`Database` objects; unnamed ones take their database name.
    With ``outbox`` (``-A``), each knows the app's limits, handlers and claim interval.

    ``NAME=`` is recognised before a ``postgresql://`` URL only (a key=value DSN has ``=`` in it).
    Raises :class:`ValueError` with a message that never quotes the DSN.
    """
    from ..web.app import Database

    limits: dict[str, Any] = {}
    handlers: frozenset[str] | None = None
    claim_interval: float | None = None
    if outbox is not None:
        limits = {et: spec.limit for et, spec in outbox.handlers.items() if getattr(spec, "limit", None)}
        handlers = frozenset(outbox.handlers)
        claim_interval = outbox.config.claim_interval
    out: list[Database] = []
    for i, value in enumerate(values, 1):
        m = _NAMED.match(value)
        name, dsn = (m.group(1), m.group(2)) if m else (None, value)
        if name is None:
            try:
                name = conninfo_to_dict(dsn).get("dbname") or f"db{i}"
            except Exception:
                raise ValueError(f"--dsn number {i} is not a valid connection string") from None
            name = re.sub(r"[^A-Za-z0-9_.-]", "_", str(name))
        if any(d.name == name for d in out):
            name = f"{name}-{i}"
        out.append(Database(name, dsn, table, limits, handlers, claim_interval))
    return out


def serve(
    databases: Sequence[Database],
    *,
    host: str,
    port: int,
    actions: bool,
    token: str | None,
    basic_auth: tuple[str, str] | None,
    flower_url: str | None,
) -> None:
    """Run the console with uvicorn until stopped (SIGINT/SIGTERM: a clean exit, status 0)."""
    import uvicorn

    from ..web.app import create_app

    app = create_app(databases, actions=actions, token=token, basic_auth=basic_auth, flower_url=flower_url)
    mode = "actions enabled" if actions else "read-only"
    shown = ", ".join(f"{d.name} ({redact(d.dsn)})" for d in databases)
    click.echo(f"outbox console ({mode}) of {shown} on http://{host}:{port}/", err=True)

    class Server(uvicorn.Server):
        # Without uvicorn's signal capture, which re-raises SIGTERM once stopped (a clean stop
        # would end with status -15): the handlers below stop it and the command exits 0.
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning", server_header=False))

    def _stop(signum: int, frame: FrameType | None) -> None:
        server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop)
    server.run()
    if not server.started:
        raise click.ClickException(f"cannot listen on {host}:{port}")
