"""What a probe needs to know about an outbox, checked from outside: ``outbox-celery health``.

:func:`check` connects with a short timeout and answers, in order, with no write:

* **database**: the server answers (a failed connect says why, password masked);
* **schema**: every migration shipped with this release is applied to the table;
* **claims**: claims ran within ``intervals`` claim intervals. Nothing is recorded per claim
  (no write per message or per claim); a running outbox claims a due message within one
  ``claim_interval`` (at once with push), so a claimable message left longer than ``intervals``
  intervals means no claim ran (:func:`~outbox_celery.ops.snapshot.unclaimed`: one range of
  each pending partial index, read only below the threshold). Paused and held event types are
  left out (waiting on purpose), and, with the handlers known (``-A``), event types no handler
  claims;
* **horizon** (a warning, never a failure): what holds the xmin horizon back
  (:func:`~outbox_celery.ops.horizon.horizon`) when a session, prepared transaction or slot
  has held it for a minute.

With the app known (``-A``), ``outbox-celery health`` adds a **broker** check: the app's Celery
broker accepts a connection (:func:`outbox_celery.cli.monitoring.broker_problem`; this module
knows nothing of Celery).

docs/operations.md, "Health checks and probes", shows the probes built on it.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from ..db import migrations
from ..dsn import error_line, invalid_dsn, redact
from ..errors import first_line
from ..table import TableName
from .durations import format_duration
from .flow import flow_states
from .horizon import horizon
from .snapshot import unclaimed

__all__ = ["CHECKS", "DEFAULT_INTERVALS", "HORIZON_WARNING_SECONDS", "Health", "check"]

#: The checks :func:`check` can run, in the order it runs them.
CHECKS = ("database", "schema", "claims")
#: Claims are overdue for a probe after this many claim intervals: more than ``stats``' attention
#: line waits (one interval and a margin), so that a slow moment restarts no worker.
DEFAULT_INTERVALS = 6
#: A horizon held this long is reported as a warning.
HORIZON_WARNING_SECONDS = 60.0


@dataclass(slots=True)
class Health:
    """The answer of :func:`check`.

    :ivar healthy: every check that ran passed.
    :ivar reason: the first failure, one line (``None`` when healthy).
    :ivar checks: per check run, ``"ok"`` or what failed (a check after a failed one that needs
        it is ``"not run"``).
    :ivar warnings: what deserves a look without failing the probe (the held horizon).
    :ivar schema_version: the highest migration applied, when the database answered.
    """

    healthy: bool = True
    reason: str | None = None
    checks: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    schema_version: int | None = None

    def fail(self, name: str, reason: str) -> None:
        """Record ``name`` as failed; the first failure is the reason."""
        self.checks[name] = reason
        if self.healthy:
            self.healthy, self.reason = False, f"{name}: {reason}"

    def line(self) -> str:
        """One line for a probe's log: ``ok ...`` or ``unhealthy: <reason>``, warnings after."""
        if self.healthy:
            text = "ok: " + ", ".join(f"{name} ok" for name in self.checks)
        else:
            text = f"unhealthy: {self.reason}"
        if self.warnings:
            text += "; warning: " + "; ".join(self.warnings)
        return text

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return asdict(self)


def check(
    dsn: str,
    table: str | TableName = "outbox",
    *,
    claim_interval: float,
    intervals: int = DEFAULT_INTERVALS,
    checks: Sequence[str] = CHECKS,
    handlers: Collection[str] | None = None,
    timeout: float = 5.0,
) -> Health:
    """Run ``checks`` (a subset of :data:`CHECKS`) against ``table`` on ``dsn``; never raises for
    what it finds (an unreachable database is a failed check).

    :param claim_interval: the outbox's ``claim_interval``; claims are overdue after
        ``intervals`` of it.
    :param handlers: the event types with a handler (``-A``); others are not expected to be
        claimed. ``None`` when unknown.
    :param timeout: seconds for the connect, unless the DSN sets ``connect_timeout``, and for
        each statement.
    """
    unknown = set(checks) - set(CHECKS)
    if unknown:
        raise ValueError(f"unknown health check(s): {', '.join(sorted(unknown))}")
    t = TableName.parse(table)
    health = Health()
    extra: dict[str, Any] = {"autocommit": True, "application_name": "outbox-celery-health"}
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.Error as exc:  # its message may quote the DSN: only its kind is shown
        health.fail("database", invalid_dsn(dsn, exc))
        return health
    if "connect_timeout" not in params:
        extra["connect_timeout"] = max(1, math.ceil(timeout))
    try:
        conn = psycopg.connect(dsn, **extra)
    except psycopg.Error as exc:
        health.fail("database", f"unreachable ({redact(dsn)}): {error_line(exc, dsn)}")
        for name in checks:
            health.checks.setdefault(name, "not run")
        return health
    with conn:
        health.checks["database"] = "ok" if "database" in checks else "reachable"
        try:
            # One read-only transaction with a local statement timeout: no startup option, which
            # PgBouncer refuses, and nothing left on a pooled server connection.
            with conn.transaction():
                conn.execute(
                    "SELECT set_config('statement_timeout', %s, true)", [f"{max(1, int(timeout * 1000))}ms"]
                )
                _run_checks(conn, t, health, checks, claim_interval, intervals, handlers)
        except psycopg.Error as exc:
            health.fail("database", f"a query failed: {first_line(exc)}")
    if "database" not in checks and health.checks.get("database") == "reachable":
        del health.checks["database"]
    return health


def _run_checks(
    conn: psycopg.Connection[Any],
    t: TableName,
    health: Health,
    checks: Sequence[str],
    claim_interval: float,
    intervals: int,
    handlers: Collection[str] | None,
) -> None:
    _schema(conn, t, health, "schema" in checks)
    if "claims" in checks:
        _claims(conn, t, health, claim_interval, intervals, handlers)
    _horizon(conn, t, health)


def _schema(conn: psycopg.Connection[Any], t: TableName, health: Health, report: bool) -> None:
    applied = migrations.applied_versions(conn, t)
    health.schema_version = max(applied) if applied else None
    if not report:
        return
    todo = migrations.pending(conn, t)
    if not applied:
        health.fail("schema", f"table {t.qualified} was never migrated: run `outbox-celery migrate`")
    elif todo:
        names = ", ".join(f"{m.version:04d}_{m.name}" for m in todo)
        health.fail("schema", f"{t.qualified} is behind: pending {names} (run `outbox-celery migrate`)")
    else:
        health.checks["schema"] = "ok"


def _claims(
    conn: psycopg.Connection[Any],
    t: TableName,
    health: Health,
    claim_interval: float,
    intervals: int,
    handlers: Collection[str] | None,
) -> None:
    if health.schema_version is None:
        health.checks["claims"] = "not run"
        return
    bound = intervals * claim_interval
    waiting = {f.event_type for f in flow_states(conn, t)}  # paused or held on purpose
    overdue = [
        u
        for u in unclaimed(conn, t, older_than=bound)
        if u.event_type not in waiting and (handlers is None or u.event_type in handlers)
    ]
    if not overdue:
        health.checks["claims"] = "ok"
        return
    oldest = max(overdue, key=lambda u: u.oldest_wait)
    total = sum(u.messages for u in overdue)
    health.fail(
        "claims",
        f"overdue: {total} ready message(s) unclaimed past {intervals} claim intervals "
        f"({format_duration(bound)}), the oldest ({oldest.event_type!r}) for "
        f"{format_duration(oldest.oldest_wait)}: is a worker consuming the claim queue "
        "running, and beat?",
    )


def _horizon(conn: psycopg.Connection[Any], t: TableName, health: Health) -> None:
    if health.schema_version is None:
        return
    h = horizon(conn, t)
    if h.held_for_long(HORIZON_WARNING_SECONDS):
        health.warnings.append(
            f"the xmin horizon is held by {h.holder()} ({h.dead_row_versions:,} dead row versions "
            "in the outbox; docs/operations.md, long transactions)"
        )
