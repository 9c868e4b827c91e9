"""``outbox-celery health`` and ``metrics``: what probes and Prometheus read of an outbox."""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

import click

from ..errors import first_line
from ..ops import durations
from ..ops import health as health_checks
from .main import cli
from .options import duration, pass_target
from .output import echo_json
from .target import DEFAULT_CLAIM_INTERVAL, Target

__all__ = ["BROKER_CHECK", "broker_problem", "health", "metrics"]


#: The check ``health`` adds with the app known (``-A``): its Celery broker accepts a connection.
BROKER_CHECK = "broker"


@cli.command()
@click.option(
    "--check",
    "checks",
    type=click.Choice((*health_checks.CHECKS, BROKER_CHECK)),
    multiple=True,
    help="Run only this check (repeatable); default: all (broker: with -A). The horizon is always "
    "reported, as a warning.",
)
@click.option(
    "--claim-intervals",
    type=click.IntRange(1),
    default=health_checks.DEFAULT_INTERVALS,
    show_default=True,
    help="Claims are overdue when a ready message waited this many claim intervals.",
)
@click.option(
    "--claim-interval",
    metavar="DURATION",
    callback=duration,
    help="The outbox's claim_interval (default: the -A Outbox's, else "
    f"{durations.format_duration(DEFAULT_CLAIM_INTERVAL)}).",
)
@click.option(
    "--timeout",
    metavar="DURATION",
    callback=duration,
    default="5s",
    show_default=True,
    help="Connect and statement timeout (the broker's connect too).",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_target
def health(
    target: Target,
    checks: tuple[str, ...],
    claim_intervals: int,
    claim_interval: float | None,
    timeout: float,
    as_json: bool,
) -> None:
    """Exit 0 when the outbox is healthy, 1 with the reason on one line (for probes).

    Checks the database answers, the schema is current, and claims ran within
    --claim-intervals claim intervals; with the app known (-A), that its Celery broker accepts
    a connection. Warns about what holds the xmin horizon.
    """
    if claim_interval is None:
        claim_interval = target.claim_interval
    outbox = target.outbox
    if BROKER_CHECK in checks and outbox is None:
        raise click.ClickException("the broker check needs the app: pass -A module:outbox")
    database_checks = tuple(c for c in checks if c != BROKER_CHECK)
    if checks and not database_checks:
        result = health_checks.Health()
    else:
        result = health_checks.check(
            target.dsn,
            target.table,
            claim_interval=claim_interval,
            intervals=claim_intervals,
            checks=database_checks or health_checks.CHECKS,
            handlers=target.handlers,
            timeout=timeout or 5.0,
        )
    if outbox is not None and (not checks or BROKER_CHECK in checks):
        problem = broker_problem(outbox.app, timeout or 5.0)
        if problem is None:
            result.checks[BROKER_CHECK] = "ok"
        else:
            result.fail(BROKER_CHECK, problem)
    if as_json:
        echo_json({"table": target.table.qualified, **result.as_dict()})
    else:
        click.echo(target.scrub(result.line()))
    if not result.healthy:
        raise SystemExit(1)


def broker_problem(app: Any, timeout: float) -> str | None:
    """Why the Celery ``app``'s broker does not accept a connection, or ``None`` when it does.

    One attempt, no retry, bounded by ``timeout`` seconds for the connect (and, on Redis, for
    its answer: a frozen server would otherwise hold the probe). The broker's password is never
    in the answer.
    """
    conn = app.connection_for_write(connect_timeout=timeout)
    try:
        if conn.transport.driver_type == "redis":
            conn.release()
            # Redis takes its socket timeouts from the transport options, not connect_timeout.
            bounded = {"socket_connect_timeout": timeout, "socket_timeout": timeout}
            conn = app.connection_for_write(connect_timeout=timeout, transport_options=bounded)
        conn.ensure_connection(max_retries=0)
    except Exception as exc:
        why = first_line(exc)
        secret = conn.password
        if secret:
            why = why.replace(str(secret), "***")
        return f"unreachable ({conn.as_uri()}): {why}"  # as_uri masks the password
    finally:
        conn.release()
    return None


# -- metrics -----------------------------------------------------------------------------------


@cli.command()
@click.option("--port", type=click.IntRange(0, 65535), default=9808, show_default=True, help="HTTP port.")
@click.option(
    "--addr",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on. The page has no authentication: 0.0.0.0 exposes event types and "
    "depths to any host that can reach this one.",
)
@click.option(
    "--timeout",
    metavar="DURATION",
    callback=duration,
    default="10s",
    show_default=True,
    help="Stats query timeout.",
)
@click.option(
    "--cap",
    type=click.IntRange(min=1),
    default=1_000,  # metrics.DEFAULT_METRICS_CAP (the module is imported only when serving)
    show_default=True,
    help="Index entries each status' read takes at most per scrape: past it outbox_messages is a "
    "lower bound (outbox_messages_capped is 1).",
)
@click.option(
    "--worker-metrics-dir",
    metavar="DIR",
    help="Also serve the delivery counters workers on this machine write there "
    "(PROMETHEUS_MULTIPROC_DIR of workers that call track_deliveries).",
)
@pass_target
def metrics(
    target: Target, port: int, addr: str, timeout: float, cap: int, worker_metrics_dir: str | None
) -> None:
    """Prometheus exporter: serve http://ADDR:PORT/metrics until stopped.

    With -A naming an Outbox that serves several databases and no --database, every database
    is served, each series labelled database=NAME first.
    """
    try:
        from ..ops.metrics import OutboxCollector, start_exporter
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise click.ClickException(first_line(exc)) from None
    if worker_metrics_dir is not None and not os.path.isdir(worker_metrics_dir):
        raise click.ClickException(f"--worker-metrics-dir {worker_metrics_dir!r} is not a directory")
    outbox, every = target.outbox, target.database_names if target.database is None else []
    try:
        if outbox is not None and every:
            # A connection of its own per database and scrape: none held between scrapes.
            collector = OutboxCollector.from_outbox(outbox, pooled=False, timeout=timeout, cap=cap)
            where = f"the databases of outbox {outbox.name} ({', '.join(every)})"
        else:
            dsn, table, handlers = target.dsn, target.table, target.handlers
            collector = OutboxCollector(dsn, table, handlers=handlers, timeout=timeout, cap=cap)
            where = target.where
    except ImportError as exc:
        raise click.ClickException(first_line(exc)) from None
    try:
        server, _registry = start_exporter(
            collector, port=port, addr=addr, worker_metrics_dir=worker_metrics_dir
        )
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {addr}:{port}: {exc.strerror or exc}") from None
    stop = threading.Event()

    def _stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop)
    click.echo(f"serving metrics of {where} on http://{addr}:{server.server_port}/metrics", err=True)
    try:
        while not stop.wait(3600):
            pass
    finally:
        server.shutdown()
        server.server_close()
