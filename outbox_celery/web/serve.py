"""``outbox-celery web``: the console's databases from the command line, served by uvicorn."""

from __future__ import annotations

import contextlib
import re
import signal
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

import click
from psycopg.conninfo import conninfo_to_dict

from ..dsn import redact
from .app import Database, create_app

_NAMED = re.compile(r"^([A-Za-z0-9_.-]+)=((?:postgres|postgresql)://.*)$", re.DOTALL)


def databases_from(values: Sequence[str], *, table: str, outbox: Any = None) -> list[Database]:
    """``[NAME=]DSN`` values as :class:`Database` objects; unnamed ones take their database name.
    With ``outbox`` (``-A``), each knows the app's limits, handlers and claim interval.

    ``NAME=`` is recognised before a ``postgresql://`` URL only (a key=value DSN has ``=`` in it).
    Raises :class:`ValueError` with a message that never quotes the DSN.
    """
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
