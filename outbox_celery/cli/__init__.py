"""The ``outbox-celery`` command line: see, steer and maintain an outbox without writing SQL.

::

    outbox-celery [--dsn DSN] [--table NAME] [-A module:outbox] COMMAND [--dsn DSN] [--table NAME] ...

    migrate [--check]                    schema up to date (--check: exit 1 when behind)
    stats [--unclaimed-after D] [--exact] [--json] depth, ages, leases, attempts, event types, what waits
    dead list [filters] [--json]         dead messages, paged by id
    dead show ID [--json]                one message (any status) and why it waits
    dead requeue ID... | --all           back to pending now, attempts reset
    dead skip ID... --reason TEXT        done on purpose (unblocks an ordered key)
    purge --older-than 7d [--dry-run]    delete old done rows in short batches
    pause EVENT_TYPE / resume EVENT_TYPE claimed by nobody until resumed (flow control)
    metrics [--port 9808]                Prometheus exporter

Also ``python -m outbox_celery`` and, inside Celery's own CLI, ``celery -A proj outbox ...``.
The database comes from ``--dsn`` or ``OUTBOX_DSN``, else from the loaded Outbox; the table from
``--table`` or ``OUTBOX_TABLE``, else the Outbox's, else ``outbox``. Passwords are never printed.
User errors print one line and exit 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from datetime import datetime
from types import FrameType
from typing import TYPE_CHECKING, Any

import click
import psycopg
from psycopg.conninfo import conninfo_to_dict

from .. import ops
from ..config import OutboxConfig, TableName
from ..db import migrations
from ..dsn import invalid_dsn, password, redact
from ..errors import OutboxError, first_line
from ..message import route as route_of
from ..message import split_route
from ..ops import health as health_checks
from ..ops import subscriptions
from .discovery import celery_outbox_finder, resolve_outbox

if TYPE_CHECKING:
    from ..app.outbox import Outbox

__all__ = ["celery_outbox", "cli", "main"]


# -- helpers -----------------------------------------------------------------------------------


def _duration(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    """Option callback: ``7d``, ``12h``, ``30m``, ``45s``, ``1w``, ``1h30m`` -> seconds."""
    if value is None:
        return None
    try:
        return ops.parse_duration(value)
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


def _message_ids(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """Argument callback: one id or a tuple of ids, each a positive integer."""
    if isinstance(value, tuple):
        return tuple(_message_id(v) for v in value)
    return _message_id(value)


class Target:
    """What a command acts on: a database, a table and, optionally, an Outbox (its handlers)."""

    def __init__(
        self,
        *,
        dsn: str | None,
        table: str | None,
        app_spec: str | None = None,
        outbox_finder: Callable[[], Outbox | None] | None = None,
    ) -> None:
        self._dsn = dsn
        self._table = table
        self._app_spec = app_spec
        self._finder = outbox_finder
        self._outbox: Outbox | None = None
        self._loaded = False

    def override(self, *, dsn: str | None = None, table: str | None = None) -> None:
        """Replace the DSN or the table (options given after the command)."""
        if dsn is not None:
            self._dsn = dsn
        if table is not None:
            self._table = table

    @property
    def outbox(self) -> Outbox | None:
        """The loaded Outbox (``-A``), or ``None``."""
        if not self._loaded:
            self._loaded = True
            if self._app_spec:
                self._outbox = resolve_outbox(self._app_spec)
            elif self._finder is not None:
                self._outbox = self._finder()
        return self._outbox

    @property
    def dsn(self) -> str:
        """``--dsn``/``OUTBOX_DSN``, else the Outbox's; a one-line error when there is none."""
        dsn = self._dsn or (self.outbox.config.dsn if self.outbox is not None else None)
        if not dsn:
            raise click.ClickException(
                "no database: pass --dsn or set OUTBOX_DSN (or -A module:outbox with a dsn)"
            )
        return dsn

    @property
    def table(self) -> TableName:
        """``--table``/``OUTBOX_TABLE``, else the Outbox's, else ``outbox``."""
        if self._table:
            return TableName.parse(self._table)
        if self.outbox is not None:
            return self.outbox.config.table
        return TableName("outbox")

    @property
    def handlers(self) -> set[str] | None:
        """Event types with a handler, when an Outbox is loaded."""
        return set(self.outbox.handlers) if self.outbox is not None else None

    @property
    def where(self) -> str:
        """``table on <dsn without password>``, safe to print."""
        return f"table {self.table.qualified} on {redact(self.dsn)}"

    def scrub(self, text: str) -> str:
        """``text`` with the DSN's password (if any) masked."""
        dsn = self._dsn
        if not dsn and self._outbox is not None:
            dsn = self._outbox.config.dsn
        try:
            secret = password(dsn) if dsn else None
        except psycopg.Error:
            secret = None
        if secret:
            text = text.replace(secret, "***")
        return text

    @contextlib.contextmanager
    def connect(self) -> Iterator[psycopg.Connection[Any]]:
        """An autocommit connection (10 s connect timeout unless the DSN sets one)."""
        dsn = self.dsn
        try:
            params = conninfo_to_dict(dsn)
        except psycopg.Error as exc:
            # The parser's message may quote the DSN, password included: only its kind is shown.
            raise click.ClickException(invalid_dsn(dsn, exc)) from None
        extra: dict[str, Any] = {"autocommit": True}
        if "connect_timeout" not in params:
            extra["connect_timeout"] = 10
        if "application_name" not in params:
            extra["application_name"] = "outbox-celery-cli"
        try:
            conn = psycopg.connect(dsn, **extra)
        except psycopg.Error as exc:
            raise click.ClickException(
                self.scrub(f"cannot connect to {redact(dsn)}: {first_line(exc)}")
            ) from None
        with conn:
            yield conn


_pass_target_object = click.make_pass_decorator(Target)


def _override_target(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """Option callback: ``--dsn``/``--table`` given after the command beat the group's."""
    if value is None:
        return
    target = ctx.find_object(Target)
    if target is not None:
        target.override(**{str(param.name): value})


def pass_target(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Pass the :class:`Target` and accept ``--dsn``/``--table`` after the command too.

    ``outbox-celery migrate --dsn ...`` is how most people type it (and how the README shows
    it); the group's options (before the command) and the environment keep working.
    """
    fn = _pass_target_object(fn)
    for name, what in (("--table", "Outbox table"), ("--dsn", "PostgreSQL connection string")):
        fn = click.option(
            name,
            metavar=name.lstrip("-").upper() if name == "--dsn" else "NAME",
            expose_value=False,
            callback=_override_target,
            help=f"{what}; same as the option before the command.",
        )(fn)
    return fn


class _Group(click.Group):
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


def _echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=_json_default, ensure_ascii=False))


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> str:
    """A plain text table; columns whose index is in ``right`` are right-aligned."""
    cells = [[str(h) for h in headers]] + [["-" if v is None else _shown(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [r[i].rjust(widths[i]) if i in right else r[i].ljust(widths[i]) for i in range(len(r))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _shown(text: Any) -> str:
    """``text`` safe to print on a terminal: producer-supplied text (event types, keys, errors)
    with a control or format character (an escape sequence, a bidi override) is shown as its
    escaped repr, quoted; plain printable text is shown as it is.
    """
    text = str(text)
    return text if text.isprintable() else repr(text)


def _shown_lines(text: str) -> str:
    """Multi-line text (a traceback) with each line made safe by :func:`_shown`."""
    return "\n".join(_shown(line) for line in text.splitlines())


def _short(text: str | None, width: int = 60) -> str:
    if not text:
        return "-"
    line = text.strip().splitlines()[0] if text.strip() else ""
    line = _shown(line)
    return line if len(line) <= width else line[: width - 3] + "..."


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
]


def _target_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(_TARGET_OPTIONS):
        fn = option(fn)
    return fn


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
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
def cli(ctx: click.Context, dsn: str | None, table: str | None, app_spec: str | None, verbose: bool) -> None:
    """See, steer and maintain a transactional outbox (PostgreSQL + Celery)."""
    _setup_logging(verbose)
    ctx.obj = Target(dsn=dsn, table=table, app_spec=app_spec)


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
                _echo_json(
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
        _echo_json({"table": table.qualified, "applied_now": applied, "applied": current})
    elif applied:
        click.echo(
            f"migrated {table.qualified}: applied version(s) {', '.join(map(str, applied))}; "
            f"now at version {max(current)}"
        )
    else:
        click.echo(f"{table.qualified} is already up to date (version {max(current)})")


def _unstarted_line(e: ops.EventTypeStats, outbox: Outbox | None) -> str:
    """A queue with no consumer shows as claims nobody starts (DESIGN invariants 10, 16)."""
    queue = "its queue"
    if outbox is not None and e.event_type in outbox.handlers:
        queue = f"queue {outbox.queue_for(e.event_type)!r}"
    return (
        f"event type {e.event_type!r}: {e.unstarted} message(s) claimed up to {e.unstarted_claims} "
        f"time(s) without a worker starting them: does {queue} have a consumer?"
    )


# A running outbox claims a due message at its next claim run, one claim interval at most (at
# once with push). A claimable message left one interval plus this margin (a claim run's own
# budget, beat sending late) is overdue: no claim ran for it.
CLAIM_OVERDUE_MARGIN = 5.0
DEFAULT_CLAIM_INTERVAL = OutboxConfig().claim_interval


def _unclaimed_after(outbox: Outbox | None) -> float:
    """``stats``' default threshold: one claim interval of the loaded Outbox (or the default)
    plus :data:`CLAIM_OVERDUE_MARGIN`: a claim is overdue from then on."""
    interval = outbox.config.claim_interval if outbox is not None else DEFAULT_CLAIM_INTERVAL
    return interval + CLAIM_OVERDUE_MARGIN


def _unclaimed_line(u: ops.Unclaimed, outbox: Outbox | None, processing: int) -> str:
    """Ready messages nobody claims: the first sign of a stopped claim worker or a missing handler."""
    if outbox is not None:
        # Its event type has a handler here (those without one are reported as unroutable).
        cause = f"is a worker consuming the claim queue {outbox.config.claim_queue!r} running, and beat?"
    else:
        cause = (
            "no claim worker running (a worker consuming the claim queue, and beat), "
            "or no handler for this event type in the app that claims"
        )
    bound = f" (or the in-flight bound is full: {processing} processing)" if processing else ""
    return (
        f"event type {u.event_type!r}: {u.messages} ready message(s) unclaimed for "
        f"{ops.format_duration(u.oldest_wait)}: {cause}{bound}"
    )


def _attention(
    s: ops.Stats, outbox: Outbox | None = None, unclaimed: Sequence[ops.Unclaimed] = ()
) -> list[str]:
    """What needs a human now, as short phrases (the figures that should be zero)."""
    items = []
    if s.dead:
        items.append(f"{s.shown('dead')} dead (outbox-celery dead list)")
    if s.blocked_keys:
        items.append(f"{s.blocked_keys} ordered key(s) blocked by a dead head")
    if s.headless_keys:
        items.append(f"{s.headless_keys} ordered key(s) without a head (outbox-celery repair-heads)")
    if s.groups.blocked:
        items.append(f"{s.groups.blocked} open group(s) with a dead member (outbox-celery groups list)")
    if s.expired_leases:
        items.append(f"{s.expired_leases} expired lease(s) (workers lost or stuck?)")
    if s.unroutable:
        items.append(f"no handler for {', '.join(map(_shown, s.unroutable))}")
    items += [_unstarted_line(e, outbox) for e in s.event_types if e.unstarted]
    # Paused and held event types are left unclaimed on purpose; stats lists them below.
    reported = set(s.unroutable or ()) | {f.event_type for f in s.flow}
    items += [
        _unclaimed_line(u, outbox, s.counts["processing"]) for u in unclaimed if u.event_type not in reported
    ]
    h = s.horizon
    if h is not None and _holds_long(h):
        items.append(
            f"the xmin horizon is held by {_shown(h.holder())}: VACUUM cleans nothing meanwhile "
            f"({h.dead_row_versions:,} dead row versions in the outbox; docs/operations.md, "
            "long transactions)"
        )
    return items


# A snapshot held this long is worth a human's look (the claim stays fast, the table grows).
HORIZON_ATTENTION_SECONDS = 60.0


def _holds_long(h: ops.Horizon) -> bool:
    if h.kind is None:
        return False
    if h.seconds is not None:
        return h.seconds >= HORIZON_ATTENTION_SECONDS
    return h.state == "inactive"  # a slot nobody consumes holds the horizon until dropped


def _done_note(outbox: Outbox | None) -> str:
    """What the done count is: finished rows still kept, not rows already deleted."""
    if outbox is None:
        return "delivered or skipped, kept until retention deletes them"
    retention = outbox.config.retention
    if retention is None:
        return "delivered or skipped, kept (retention is off)"
    after = ops.format_duration(retention)
    return f"delivered or skipped, deleted by retention {after} after they finish"


@cli.command()
@click.option(
    "--unclaimed-after",
    metavar="DURATION",
    callback=_duration,
    help="Report ready messages left unclaimed this long (default: a claim interval of the -A "
    f"Outbox plus {ops.format_duration(CLAIM_OVERDUE_MARGIN)}, else "
    f"{ops.format_duration(DEFAULT_CLAIM_INTERVAL + CLAIM_OVERDUE_MARGIN)}).",
)
@click.option(
    "--exact",
    is_flag=True,
    help=f"Count every row (the cost grows with the table) instead of reading each status up to "
    f"{ops.DEFAULT_STATS_CAP:,} index entries.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_target
def stats(target: Target, unclaimed_after: float | None, exact: bool, as_json: bool) -> None:
    """Health at a glance: depth, ages, leases, attempts, event types.

    Ready messages that no claim took within a claim interval (plus a margin) are flagged (a stopped claim
    worker or beat, or an event type no claiming app handles). With -A, pending event types
    that have no handler are reported as unroutable. Each status is read up to a cap (a count
    shown as N+ is at least N) and the done count past it is estimated: the command costs the
    same whatever the done history holds; --exact counts everything.
    """
    threshold = unclaimed_after if unclaimed_after is not None else _unclaimed_after(target.outbox)
    s, waiting = _read_stats(target, threshold, exact)
    attention = _attention(s, target.outbox, waiting)
    if as_json:
        _echo_json(
            {
                **s.as_dict(),
                "unclaimed_after": threshold,
                "unclaimed": [u.as_dict() for u in waiting],
                "attention": attention,
            }
        )
        return
    click.echo(f"outbox {target.where}")
    click.echo(f"database time {s.now:%Y-%m-%d %H:%M:%S %Z}")
    click.echo(f"attention: {'; '.join(attention) or 'none'}")
    click.echo("")
    _echo_status_counts(s, target.outbox)
    _echo_facts(s)
    _echo_attempts(s)
    _echo_event_types(s, target.handlers)
    _echo_flow(s)
    _echo_unroutable(s)


def _read_stats(target: Target, threshold: float, exact: bool) -> tuple[ops.Stats, list[ops.Unclaimed]]:
    """``stats``' reads: the capped (or, with --exact, full) counts and the unclaimed event types."""
    cap = None if exact else ops.DEFAULT_STATS_CAP
    with target.connect() as conn:
        s = ops.stats(conn, target.table, handlers=target.handlers, cap=cap)
        waiting = ops.unclaimed(conn, target.table, older_than=threshold, cap=cap)
    return s, waiting


def _echo_status_counts(s: ops.Stats, outbox: Outbox | None) -> None:
    """The table of messages per status, each with what its figure means."""
    in_order = s.counts["pending"] - s.ready - s.scheduled
    notes = {
        "pending": f"{s.ready} ready now, {s.scheduled} scheduled later (delay/backoff/defer), "
        f"{in_order} waiting behind their ordering key's head",
        "processing": f"{s.expired_leases} with an expired lease",
        "dead": "need a human: outbox-celery dead list" if s.dead else "",
        "done": _done_note(outbox),
    }
    if s.capped.get("done"):
        notes["done"] = f"estimated (table statistics); {notes['done']}"
    if s.done_last_minute or s.counts["done"]:
        minute = f"{s.done_last_minute}+" if s.capped.get("done") else str(s.done_last_minute)
        notes["done"] = f"{minute} in the last minute; {notes['done']}"
    rows = [(st, s.shown(st), notes[st]) for st in ("pending", "processing", "dead", "done")]
    click.echo(_table(["status", "messages", ""], rows, right=[1]))
    if any(s.capped.values()):
        click.echo(
            f"N+: at least N (each status is read up to {s.cap:,} index entries; "
            "the figures below count the rows read)"
        )
    click.echo("")


def _echo_facts(s: ops.Stats) -> None:
    """Ages, leases, ordered keys, groups and the xmin horizon, one labelled line each."""
    for label, value in _age_facts(s) + _group_facts(s) + _horizon_facts(s):
        click.echo(f"{label + ':':<46}{value}")
    click.echo("")


def _age_facts(s: ops.Stats) -> list[tuple[str, Any]]:
    fd = ops.format_duration
    return [
        ("oldest pending (since created)", fd(s.oldest_pending_age)),
        ("oldest ready wait (claimable, not claimed)", fd(s.oldest_ready_wait)),
        ("oldest processing (since created)", fd(s.oldest_processing_age)),
        ("expired leases", s.expired_leases),
        (
            "ordered keys blocked by a dead head",
            f"{s.blocked_keys} ({s.blocked_messages} message(s) waiting)",
        ),
        ("ordered keys without a head", s.headless_keys),
    ]


def _group_facts(s: ops.Stats) -> list[tuple[str, Any]]:
    g = s.groups
    return [
        (
            "open groups (oldest)",
            f"{g.open}{'+' if g.capped else ''} ({ops.format_duration(g.oldest_open_age)}), "
            f"{g.blocked} blocked by a dead member",
        ),
    ]


def _horizon_facts(s: ops.Stats) -> list[tuple[str, Any]]:
    h = s.horizon
    if h is None:
        return []
    fd = ops.format_duration
    return [
        ("xmin horizon held by", _shown(h.holder())),
        (
            "dead row versions (table statistics)",
            f"{h.dead_row_versions:,} beside {h.live_row_versions:,} live; last vacuum "
            + (f"{fd(h.last_vacuum_age)} ago" if h.last_vacuum_age is not None else "never"),
        ),
    ]


def _echo_attempts(s: ops.Stats) -> None:
    if not s.attempts:
        return
    click.echo("attempts histogram (live messages)")
    click.echo(
        _table(
            ["attempts", "pending", "processing", "dead"],
            [(a.attempts, a.pending, a.processing, a.dead) for a in s.attempts],
            right=[0, 1, 2, 3],
        )
    )
    click.echo("")


def _echo_event_types(s: ops.Stats, handlers: Collection[str] | None) -> None:
    """Live messages per event type (with -A, whether a handler takes it)."""
    if not s.event_types:
        click.echo("no live messages (nothing pending, processing or dead)")
        return
    fd = ops.format_duration
    headers = ["event type", "pending", "ready", "processing", "dead", "unstarted", "oldest pending"]
    if handlers is not None:
        headers.append("handler")
    rows: list[list[Any]] = []
    for e in s.event_types:
        r: list[Any] = [
            e.event_type,
            e.pending,
            e.ready,
            e.processing,
            e.dead,
            e.unstarted,
            fd(e.oldest_pending_age),
        ]
        if handlers is not None:
            r.append("yes" if e.has_handler else "NO")
        rows.append(r)
    click.echo(_table(headers, rows, right=[1, 2, 3, 4, 5]))
    click.echo("")


def _echo_flow(s: ops.Stats) -> None:
    """Paused and held event types and limit keys: left unclaimed on purpose."""
    fd = ops.format_duration
    paused = [_shown(f.event_type) for f in s.flow if f.paused]
    held = [f"{_shown(f.event_type)} ({fd(f.held_for)} left)" for f in s.flow if not f.paused and f.held_for]
    click.echo(f"paused (claimed by nobody until resumed): {', '.join(paused) or 'none'}")
    if held:
        click.echo(f"held by a RateLimited outcome: {', '.join(held)}")
    if s.keys:
        shown = [
            f"{_shown(k.event_type)} key {_shown(k.limit_key)} ("
            + ("paused" if k.paused else f"held, {fd(k.held_for)} left")
            + ")"
            for k in s.keys
        ]
        click.echo(f"limit keys claimed by nobody: {', '.join(shown)}")


def _echo_unroutable(s: ops.Stats) -> None:
    if s.unroutable is None:
        click.echo("unroutable: unknown (pass -A module:outbox to check event types against the handlers)")
    elif s.unroutable:
        click.echo(f"unroutable (pending, no handler): {', '.join(map(_shown, s.unroutable))}")
    else:
        click.echo("unroutable: none")


# -- dead letters ------------------------------------------------------------------------------


@cli.group(cls=_Group)
def dead() -> None:
    """Dead letters: list, show, requeue, skip."""


@dead.command("list")
@click.option("--event-type", help="Only this event type.")
@click.option("--aggregate-type", help="Only this aggregate type.")
@click.option("--aggregate-id", help="Only this aggregate id.")
@click.option(
    "--older-than",
    metavar="DURATION",
    callback=_duration,
    help="Created more than this long ago (7d, 12h...).",
)
@click.option("--newer-than", metavar="DURATION", callback=_duration, help="Created less than this long ago.")
@click.option("--limit", type=click.IntRange(1, 10000), default=50, show_default=True, help="Page size.")
@click.option("--after", type=click.IntRange(0), default=0, help="Page after this id (the last one shown).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_target
def dead_list(
    target: Target,
    event_type: str | None,
    aggregate_type: str | None,
    aggregate_id: str | None,
    older_than: float | None,
    newer_than: float | None,
    limit: int,
    after: int,
    as_json: bool,
) -> None:
    """Dead messages, oldest id first, with their last error."""
    filters: ops.DeadFilters = {
        "event_type": event_type,
        "aggregate_type": aggregate_type,
        "aggregate_id": aggregate_id,
        "older_than": older_than,
        "newer_than": newer_than,
    }
    with target.connect() as conn:
        rows = ops.list_dead(conn, target.table, after=after, limit=limit, **filters)
        total = ops.count_dead(conn, target.table, **filters)
    next_after = rows[-1].id if rows and len(rows) == limit else None
    if as_json:
        _echo_json({"total": total, "messages": [r.as_dict() for r in rows], "next_after": next_after})
        return
    if not rows:
        if after and total:
            click.echo(f"no more dead messages after id {after} ({total} match)")
        elif any(v is not None for v in filters.values()):
            click.echo("no dead messages match these filters")
        else:
            click.echo("no dead messages")
        return
    click.echo(
        _table(
            ["id", "event type", "aggregate", "attempts", "age", "blocks", "last error"],
            [
                (
                    r.id,
                    r.event_type,
                    _shown(f"{r.aggregate_type}:{r.aggregate_id}"),
                    r.attempts,
                    ops.format_duration(r.age),
                    r.waiting_behind if r.ordering_key is not None else "-",
                    _short(r.last_error),
                )
                for r in rows
            ],
            right=[0, 3, 5],
        )
    )
    more = f"; next page: --after {next_after}" if next_after is not None else ""
    click.echo(f"{len(rows)} shown of {total} matching dead message(s){more}")


@dead.command("show")
@click.argument("outbox_id", metavar="ID", callback=_message_ids)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_target
def dead_show(target: Target, outbox_id: int, as_json: bool) -> None:
    """One message (any status) and why it waits.

    Payload, attempts, lease, last error and, for an ordered message, its key's head.
    """
    with target.connect() as conn:
        row = ops.get_message(conn, target.table, outbox_id)
    if row is None:
        raise click.ClickException(f"no message with id {outbox_id} in {target.table.qualified}")
    if as_json:
        _echo_json(row)
        return
    fd = ops.format_duration
    status = row["status"]
    lines = [
        ("id", row["id"]),
        ("status", status),
        ("event type", _shown(row["event_type"])),
        ("aggregate", _shown(f"{row['aggregate_type']}:{row['aggregate_id']}")),
        ("created", f"{row['created_at']:%Y-%m-%d %H:%M:%S %Z} ({fd(row['age'])} ago)"),
        ("attempts", row["attempts"]),
        ("lease version", row["lease_version"]),
    ]
    if status == "pending":
        wait = row["available_in"]
        lines.append(("available", f"in {fd(wait)}" if wait > 0 else f"now (due {fd(-wait)} ago)"))
    if status == "processing":
        exp = row["lease_expires_in"]
        lease = f"expires in {fd(exp)}" if exp is not None and exp > 0 else f"EXPIRED {fd(-(exp or 0))} ago"
        lines.append(("lease", f"{lease}, owner {_shown(row['lease_owner'] or '-')}"))
    unstarted = int(row.get("unstarted_claims") or 0)
    if status in ("pending", "processing") and unstarted:
        # Claims whose task no worker started (DESIGN invariants 10, 16): a live lease's own
        # claim may still start; more than that means tasks were lost.
        lines.append(("unstarted", f"{unstarted} claim(s) since a worker last started it"))
    if row["done_at"] is not None:
        lines.append(("done at", f"{row['done_at']:%Y-%m-%d %H:%M:%S %Z}"))
    if row["ordering_key"] is not None:
        head = row["key_head"]
        if head is None and (status != "done" or row["waiting_behind"]):
            position = "no message of the key is its head: none is claimed (outbox-celery repair-heads)"
        elif head is None:
            position = "every message of the key is done"
        elif head == row["id"]:
            position = f"head of its key; {row['waiting_behind']} message(s) wait behind it"
        else:
            position = f"waits behind id {head}, the head of its key"
        lines.append(("ordering key", f"{_shown(row['ordering_key'])} ({position})"))
    for label, value in lines:
        click.echo(f"{label + ':':<15}{value}")
    click.echo("payload:")
    click.echo(_shown_lines(json.dumps(row["payload"], indent=2, ensure_ascii=False)))
    click.echo("last error:")
    click.echo(_shown_lines(row["last_error"] or "-"))
    expired = status == "processing" and (row["lease_expires_in"] or 0) <= 0
    if status == "dead" or expired:
        click.echo("")
        click.echo(
            f"fix: outbox-celery dead requeue {row['id']}   |   "
            f"outbox-celery dead skip {row['id']} --reason '...'"
        )


@dead.command("requeue")
@click.argument("ids", metavar="[ID]...", nargs=-1, callback=_message_ids)
@click.option("--all", "all_", is_flag=True, help="Every dead message (narrow with --event-type).")
@click.option("--event-type", help="With --all: only dead messages of this event type.")
@click.option("--reason", help="Recorded in last_error.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_target
def dead_requeue(
    target: Target,
    ids: tuple[int, ...],
    all_: bool,
    event_type: str | None,
    reason: str | None,
    as_json: bool,
) -> None:
    """Deliver again: back to pending now, attempts reset.

    The old error is kept in last_error behind a prefix. Processing messages whose lease
    expired (lost task, removed handler) can be requeued by id; live leases are refused.

    Give ids, or --all. Unknown or not-dead ids refuse the whole command.
    """
    if ids and all_:
        raise click.ClickException("give message ids or --all, not both")
    if not ids and not all_:
        raise click.ClickException("nothing to requeue: give message ids or --all")
    if event_type is not None and not all_:
        raise click.ClickException("--event-type filters --all; with ids it is not needed")
    with target.connect() as conn:
        if all_:
            n = ops.requeue_all(conn, target.table, event_type=event_type, reason=reason)
            changed: list[int] | None = None
        else:
            changed = ops.requeue(conn, target.table, ids, reason=reason)
            n = len(changed)
    if as_json:
        _echo_json({"requeued": n, "ids": changed})
        return
    scope = f" of event type {_shown(event_type)}" if event_type else ""
    listed = f": {', '.join(map(str, changed))}" if changed else ""
    click.echo(f"requeued {n} dead message(s){scope}{listed}")


@dead.command("skip")
@click.argument("ids", metavar="ID...", nargs=-1, callback=_message_ids)
@click.option("--reason", help="Why it is skipped (required; recorded in last_error).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_target
def dead_skip(target: Target, ids: tuple[int, ...], reason: str | None, as_json: bool) -> None:
    """Never deliver: mark dead (or pending) messages done.

    Unblocks an ordered key whose head can never be delivered. The reason is recorded.
    Processing messages whose lease expired can be skipped; live leases are refused.
    """
    if not ids:
        raise click.ClickException("nothing to skip: give message ids")
    if reason is None or not reason.strip():
        raise click.ClickException("skip needs --reason TEXT (it is recorded in last_error)")
    with target.connect() as conn:
        changed = ops.skip(conn, target.table, ids, reason=reason)
    if as_json:
        _echo_json({"skipped": len(changed), "ids": changed})
        return
    click.echo(f"skipped {len(changed)} message(s): {', '.join(map(str, changed))}")


# -- retention ---------------------------------------------------------------------------------


@cli.command()
@click.option(
    "--older-than",
    metavar="DURATION",
    callback=_duration,
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
    age = ops.format_duration(older_than)
    with target.connect() as conn:
        if dry_run:
            n = ops.count_purgeable(conn, target.table, older_than=older_than)
        else:
            n = ops.purge_done(conn, target.table, older_than=older_than, batch_size=batch_size)
    if as_json:
        _echo_json(
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
        keys = ops.repair_heads(conn, target.table, batch_size=batch_size)
    if as_json:
        _echo_json({"repaired": len(keys), "keys": keys})
    else:
        click.echo(f"repaired {len(keys)} ordering key(s) without a head")


# -- flow control ------------------------------------------------------------------------------


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
        hint = f"; its handlers: {', '.join(_shown(h) for h in sorted(handlers))}"
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
        changed = ops.pause(conn, target.table, event_type, limit_key=limit_key)
        routes = ops.flow_targets(conn, target.table, event_type)[1:]
    what = _flow_what(event_type, limit_key, routes)
    if as_json:
        _echo_json(
            {
                "event_type": event_type,
                "limit_key": limit_key,
                "routes": routes,
                "paused": True,
                "changed": changed,
            }
        )
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
        changed = ops.resume(conn, target.table, event_type, limit_key=limit_key)
        routes = ops.flow_targets(conn, target.table, event_type)[1:]
        held: list[str] = []
        if not changed:
            if limit_key is None:
                held = [f.event_type for f in ops.flow_states(conn, target.table)]
            else:
                held = [k.limit_key for k in ops.key_states(conn, target.table) if k.event_type == event_type]
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
        _echo_json(
            {
                "event_type": event_type,
                "limit_key": limit_key,
                "routes": routes,
                "paused": False,
                "changed": changed,
            }
        )
    elif changed:
        click.echo(f"resumed {what}: its messages are claimable now")
    else:
        hint = "" if close is None else f"; did you mean {close if limit_key is not None else repr(close)}?"
        click.echo(f"{what} was not paused or held: nothing changed{hint}")


# -- health ------------------------------------------------------------------------------------


@cli.command()
@click.option(
    "--check",
    "checks",
    type=click.Choice(health_checks.CHECKS),
    multiple=True,
    help="Run only this check (repeatable); default: all. The horizon is always reported, as a warning.",
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
    callback=_duration,
    help="The outbox's claim_interval (default: the -A Outbox's, else "
    f"{ops.format_duration(DEFAULT_CLAIM_INTERVAL)}).",
)
@click.option(
    "--timeout",
    metavar="DURATION",
    callback=_duration,
    default="5s",
    show_default=True,
    help="Connect and statement timeout.",
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
    --claim-intervals claim intervals; warns about what holds the xmin horizon.
    """
    outbox = target.outbox
    if claim_interval is None:
        claim_interval = outbox.config.claim_interval if outbox is not None else DEFAULT_CLAIM_INTERVAL
    result = health_checks.check(
        target.dsn,
        target.table,
        claim_interval=claim_interval,
        intervals=claim_intervals,
        checks=checks or health_checks.CHECKS,
        handlers=target.handlers,
        timeout=timeout or 5.0,
    )
    if as_json:
        _echo_json({"table": target.table.qualified, **result.as_dict()})
    else:
        click.echo(target.scrub(result.line()))
    if not result.healthy:
        raise SystemExit(1)


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
    callback=_duration,
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
    """Prometheus exporter: serve http://ADDR:PORT/metrics until stopped."""
    try:
        from ..ops.metrics import OutboxCollector, start_exporter
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise click.ClickException(first_line(exc)) from None
    if worker_metrics_dir is not None and not os.path.isdir(worker_metrics_dir):
        raise click.ClickException(f"--worker-metrics-dir {worker_metrics_dir!r} is not a directory")
    dsn, table, handlers = target.dsn, target.table, target.handlers
    try:
        collector = OutboxCollector(dsn, table, handlers=handlers, timeout=timeout, cap=cap)
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
    click.echo(f"serving metrics of {target.where} on http://{addr}:{server.server_port}/metrics", err=True)
    try:
        while not stop.wait(3600):
            pass
    finally:
        server.shutdown()
        server.server_close()


# -- web console -------------------------------------------------------------------------------


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
@_pass_target_object
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


# -- subscriptions -----------------------------------------------------------------------------


@cli.group("subscriptions", cls=_Group)
def subscriptions_group() -> None:
    """List, add and remove the subscriptions the producers fan events out to (DESIGN invariant 28).

    A subscription is a named handler of an event type (@outbox.handler("order.paid",
    name="receipt")); its messages carry the route order.paid@receipt wherever an event type is
    shown or given (stats, dead, pause, resume, metrics). Workers add their handlers'
    subscriptions at start-up.
    """


def _since(conn: psycopg.Connection[Any], text: str) -> datetime:
    """A duration back from the database's now() (``7d``) or an ISO time (``2026-12-01T00:00Z``)."""
    try:
        back = ops.parse_duration(text)
    except ValueError:
        try:
            return datetime.fromisoformat(text)
        except ValueError:
            raise click.ClickException(
                f"--replay-since {text!r}: give a duration back from now (7d, 12h) or an ISO time"
            ) from None
    row = conn.execute("SELECT now() - make_interval(secs => %s)", [back]).fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


@subscriptions_group.command("list")
@click.option("--event-type", help="Only this event type.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_target
def subscriptions_list(target: Target, event_type: str | None, as_json: bool) -> None:
    """Every subscription (removed ones too) with its unfinished messages."""
    with target.connect() as conn:
        found = subscriptions.list_subscriptions(conn, target.table, event_type=event_type)
    if as_json:
        _echo_json([s.as_dict() for s in found])
        return
    if not found:
        click.echo("no subscriptions")
        return
    rows = [
        (
            _shown(s.route),
            f"{s.created_at:%Y-%m-%d %H:%M:%S}",
            f"removed {s.removed_at:%Y-%m-%d %H:%M:%S}" if s.removed_at else "live",
            s.pending,
            s.processing,
            s.dead,
        )
        for s in found
    ]
    click.echo(_table(["route", "created", "state", "pending", "processing", "dead"], rows, right=[3, 4, 5]))


@subscriptions_group.command("add")
@click.argument("event_type")
@click.argument("name")
@click.option(
    "--replay-since",
    metavar="WHEN",
    help="First replay the retained events of EVENT_TYPE from WHEN (7d, or an ISO time), in batches.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_target
def subscriptions_add(
    target: Target, event_type: str, name: str, replay_since: str | None, as_json: bool
) -> None:
    """Add subscription NAME of EVENT_TYPE: it receives the events written after this commits."""
    with target.connect() as conn:
        since = _since(conn, replay_since) if replay_since else None
        replayed = subscriptions.add(conn, target.table, event_type, name, replay_since=since)
    route = route_of(event_type, name)
    if as_json:
        _echo_json({"route": route, "replayed": replayed})
    else:
        click.echo(
            f"subscription {_shown(route)} added" + (f"; {replayed} event(s) replayed" if since else "")
        )


@subscriptions_group.command("remove")
@click.argument("event_type")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_target
def subscriptions_remove(target: Target, event_type: str, name: str, as_json: bool) -> None:
    """Remove subscription NAME of EVENT_TYPE: producers stop fanning out to it at once.

    Its undelivered messages stay as they are, visible under its route (stats, dead list,
    subscriptions list); skip or purge them deliberately.
    """
    with target.connect() as conn:
        changed = subscriptions.remove(conn, target.table, event_type, name)
    route = route_of(event_type, name)
    if as_json:
        _echo_json({"route": route, "removed": changed})
    elif changed:
        click.echo(f"subscription {_shown(route)} removed: new events no longer go to it")
    else:
        click.echo(f"{_shown(route)} is not a live subscription: nothing changed")


# -- groups ------------------------------------------------------------------------------------


@cli.group("groups", cls=_Group)
def groups_() -> None:
    """Groups with a callback: list, show, finish, cancel (DESIGN invariant 29)."""


def _group_rows(found: Sequence[ops.GroupInfo]) -> list[tuple[Any, ...]]:
    fd = ops.format_duration
    return [
        (g.id, g.state, g.progress, g.dead, _shown(g.event_type), fd(g.age), g.callback_id or "-")
        for g in found
    ]


@groups_.command("list")
@click.option(
    "--state",
    type=click.Choice(["open", "fired", "skipped", "cancelled", "finished", "any"]),
    default="open",
    show_default=True,
)
@click.option("--limit", type=click.IntRange(1, 10000), default=50, show_default=True, help="The newest N.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_target
def groups_list(target: Target, state: str, limit: int, as_json: bool) -> None:
    """Groups and their progress (members final, of all), the newest first."""
    with target.connect() as conn:
        found = ops.list_groups(conn, target.table, state=None if state == "any" else state, limit=limit)
    if as_json:
        _echo_json([dataclasses.asdict(g) for g in found])
        return
    headers = ["id", "state", "progress", "dead", "callback", "age", "callback id"]
    click.echo(_table(headers, _group_rows(found), right=[0, 3]) if found else f"no {state} group")


@groups_.command("show")
@click.argument("group_id", metavar="ID", type=click.IntRange(1))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_target
def groups_show(target: Target, group_id: int, as_json: bool) -> None:
    """One group, and its dead members with their last errors (the first 100)."""
    with target.connect() as conn:
        g = ops.get_group(conn, target.table, group_id)
        dead = ops.group_outcomes(conn, target.table, group_id, limit=100)
    if as_json:
        _echo_json({**dataclasses.asdict(g), "dead_members": [dataclasses.asdict(d) for d in dead]})
        return
    click.echo(
        _table(["id", "state", "progress", "dead", "callback", "age", "callback id"], _group_rows([g]))
    )
    for d in dead:
        click.echo(f"dead member {d.id} ({_shown(d.event_type)}): {_shown(d.last_error or '-')}")
    if g.state == "open" and g.dead:
        click.echo(
            "fix: outbox-celery dead requeue ID | outbox-celery dead skip ID --reason '...' | "
            f"outbox-celery groups finish {g.id} --reason '...' | "
            f"outbox-celery groups cancel {g.id} --reason '...'"
        )


@groups_.command("finish")
@click.argument("group_id", metavar="ID", type=click.IntRange(1))
@click.option("--reason", required=True, help="Recorded with the group.")
@pass_target
def groups_finish(target: Target, group_id: int, reason: str) -> None:
    """Close an open group now and enqueue its callback with the outcomes so far."""
    with target.connect() as conn:
        callback = ops.finish_group(conn, target.table, group_id, reason=reason)
    click.echo(f"group {group_id} finished by hand; its callback is outbox id {callback}")


@groups_.command("cancel")
@click.argument("group_id", metavar="ID", type=click.IntRange(1))
@click.option("--reason", required=True, help="Recorded with the group.")
@pass_target
def groups_cancel(target: Target, group_id: int, reason: str) -> None:
    """Close an open group for good: its callback is never enqueued."""
    with target.connect() as conn:
        ops.cancel_group(conn, target.table, group_id, reason=reason)
    click.echo(f"group {group_id} cancelled; no callback will be enqueued")


# -- entry points ------------------------------------------------------------------------------


@click.group("outbox", cls=_Group)
@_target_options
@click.option(
    "--outbox", "outbox_name", metavar="NAME", help="Which Outbox of the app (by name) when it has several."
)
@click.pass_context
def celery_outbox(ctx: click.Context, dsn: str | None, table: str | None, outbox_name: str | None) -> None:
    """Operate the app's transactional outbox (same commands as outbox-celery)."""
    _setup_logging(False)
    ctx.obj = Target(dsn=dsn, table=table, outbox_finder=celery_outbox_finder(ctx, outbox_name))


# One command table for both entry points: a command defined on ``cli`` anywhere, before or after
# this line, is also a ``celery outbox`` command.
celery_outbox.commands = cli.commands


def main(argv: Sequence[str] | None = None) -> None:
    """Run the CLI (the ``outbox-celery`` console script and ``python -m outbox_celery``)."""
    cli.main(args=list(argv) if argv is not None else None)
