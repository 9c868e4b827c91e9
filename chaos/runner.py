"""A chaos run: real beat and workers over a mixed workload, faults injected while it flows.

One Outbox serves two databases on the same server (``one`` and ``two``); the workload is spread
over both and every invariant is checked in each. The run owns every process it starts (Celery
beat, a claim worker, two delivery workers, a Redis server without persistence, pgbouncer, an
embedded PostgreSQL unless ``--dsn`` is given) and stops them all on the way out, whatever
happens. See docs/chaos.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psycopg

from outbox_celery.config import OutboxConfig
from outbox_celery.db.migrations import migrate
from outbox_celery.dsn import redact
from outbox_celery.ops import subscriptions
from outbox_celery.produce.enqueue import enqueue_many

from .check import (
    FaultRecord,
    Report,
    check,
    check_groups,
    check_subscribed,
    load_seen,
    render,
    split_seen,
)
from .procs import Child, Supervisor, child_pids
from .services import CONTROL_APP, PgBouncer, Postgres, RedisServer, connect
from .workload import (
    DATABASES,
    DSN_ENV,
    EFFECTS_DDL,
    FANOUT,
    SUBSCRIBED,
    Producer,
    for_database,
    plan,
    plan_early,
    plan_groups,
)

__all__ = ["FAULTS", "Profile", "main"]

ROOT = Path(__file__).resolve().parent.parent
DELIVERY_WORKERS = ("w1", "w2")
# The database the database_outage fault takes away; the others must keep delivering.
OUTAGE_DATABASE = DATABASES[-1]


@dataclass(frozen=True)
class Profile:
    """Sizes and durations of a run."""

    messages: int
    lease: float
    claim_interval: float
    settle: float  # seconds between faults
    outage_leases: float  # deploy outage and database outage length, in leases
    window_leases: float  # clock-skew and pgbouncer windows, in leases
    drain_timeout: float
    slow_max: float
    keys: int
    child_kills: int
    backend_kills: int
    pin_leases: float  # pinned horizon length, in leases
    groups: int = 0  # groups with a callback (DESIGN invariant 29)
    group_size: int = 0
    kill_every: float = 0.0  # SIGKILL a delivery worker's child every this many seconds (0: never)
    early: int = 0  # chaos.late events written before any worker registered their subscriptions


FULL = Profile(
    messages=6000,
    lease=3.0,
    claim_interval=0.25,
    settle=6.0,
    outage_leases=4,
    window_leases=5,
    drain_timeout=240.0,
    slow_max=1.0,
    keys=8,
    child_kills=6,
    backend_kills=3,
    pin_leases=20,
    groups=200,
    group_size=50,
    # More unordered ones than a claim's fan-out batch (1000): the claims after the first go on.
    # Alternating between the two databases: 1,600 each, so each database alone has more than
    # a claim fans out at a time.
    early=3200,
)
SHORT = Profile(
    messages=2000,
    lease=2.0,
    claim_interval=0.25,
    settle=3.0,
    outage_leases=3,
    window_leases=4,
    drain_timeout=90.0,
    slow_max=0.5,
    keys=6,
    child_kills=3,
    backend_kills=2,
    pin_leases=16,
    groups=20,
    group_size=10,
    early=150,
)

# Every fault, in the order a run injects them.
FAULTS = (
    "child_kills",
    "worker_kill",
    "broker_restart",
    "broker_flush",
    "deploy_outage",
    "backend_kills",
    "database_outage",
    "pinned_horizon",
    "pg_restart",
    "clock_ahead",
    "clock_behind",
    "pgbouncer",
)

# Seconds the database_outage fault waits for the first delivery in the database once it is
# back (only reported: the end check wants every row delivered).
RESUME_WAIT = 20.0

# Seconds the first claims have to fan out the bare chaos.late rows once the workers are up.
FAN_OUT_WAIT = 30.0

# What a claim logs when it fans bare rows out (outbox_celery/claim/fan_out.py).
FANNED_LOG = re.compile(r"outbox: (\d+) row\(s\) of a subscribed type had no route")

# Faults that run the workers differently for a window; consecutive ones chain their restarts.
WINDOW_FAULTS = ("clock_ahead", "clock_behind", "pgbouncer")

# What docs/celery.md tells PgBouncer users to set (transaction pooling; a pgbouncer older than
# 1.21 cannot keep prepared statements across server sessions). Where the library has no such
# setting yet, nothing is passed and the window shows what happens without it.
PGBOUNCER_SETTINGS = (
    json.dumps({"prepare_threshold": None})
    if "prepare_threshold" in OutboxConfig.__dataclass_fields__
    else None
)


class Interrupted(Exception):  # noqa: N818 - a request, not an error
    """SIGTERM or SIGHUP: stop everything and exit."""


def _log(start: float, text: str) -> None:
    print(
        f"[{time.strftime('%H:%M:%S', time.gmtime())} t+{time.monotonic() - start:6.1f}s] {text}", flush=True
    )


class Run:
    """One chaos run over ``postgres`` (already created) with its own Redis and processes."""

    def __init__(self, profile: Profile, postgres: Postgres, state_dir: Path, seed: int) -> None:
        self.p = profile
        self.pg = postgres
        self.state_dir = state_dir
        self.rng = random.Random(seed)
        self.seed = seed
        self.logs = state_dir / "logs"
        self.seen = state_dir / "seen.jsonl"
        self.markers = state_dir / "markers"
        self.markers.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "OUTBOX_", "FAKETIME"))}
        env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        self.procs = Supervisor(self.logs, env, ROOT)
        self.redis = RedisServer(self.procs, state_dir / "redis")
        self.workers: dict[str, Child] = {}
        self.beat: Child | None = None
        self.faults: list[FaultRecord] = []
        self.start = time.monotonic()
        self.faketime = shutil.which("faketime")
        # Workers run skewed or through pgbouncer (the window faults) until ensure_normal().
        self.altered = False
        self.bouncer: PgBouncer | None = None
        self.autovacuum = "?"
        self.periodic_kills = 0
        self._stop_kills = threading.Event()
        # The chaos.late events written before any worker: how many were bare, and how long
        # after the workers were up the claims took to fan them all out (None: not in time).
        self.early_bare = 0
        self.early_fanned_in: float | None = None

    # -- processes ---------------------------------------------------------------------------

    def _env(self, dsns: dict[str, str] | None = None) -> dict[str, str]:
        return {
            **{DSN_ENV[db]: dsn for db, dsn in (dsns or self.pg.dsns).items()},
            "CHAOS_BROKER_URL": self.redis.url,
            "CHAOS_LEASE": str(self.p.lease),
            "CHAOS_CLAIM_INTERVAL": str(self.p.claim_interval),
            "CHAOS_SEEN": str(self.seen),
            "CHAOS_MARKERS": str(self.markers),
        }

    def start_worker(self, name: str) -> Child:
        """Start worker ``name`` (``claim`` or a delivery worker) and wait until it consumes."""
        return self.start_workers((name,))[0]

    def start_workers(
        self,
        names: tuple[str, ...],
        *,
        dsns: dict[str, str] | None = None,
        skew: str | None = None,
        settings: str | None = None,
    ) -> list[Child]:
        """Start workers ``names`` side by side, then wait until every one consumes.

        ``dsns`` (database -> DSN), ``skew`` (a faketime offset such as ``+5s``) and ``settings``
        (JSON of extra Outbox settings) replace the normal ones.
        """
        started: list[tuple[Child, int]] = []
        for name in names:
            celery = [sys.executable, "-m", "celery", "-A", "chaos.app", "worker", "-l", "INFO"]
            celery += ["-n", f"{name}@%h", "--without-gossip", "--without-mingle", "--without-heartbeat"]
            if name == "claim":
                celery += ["-Q", "chaos.claim", "-P", "solo", "-c", "1"]
            else:
                celery += ["-Q", "chaos.deliver", "-P", "prefork", "-c", "2"]
            env = self._env(dsns)
            if settings:
                env["CHAOS_OUTBOX_SETTINGS"] = settings
            if skew:
                assert self.faketime is not None
                # The monotonic clock is shifted too, consistently within each process (with
                # FAKETIME_DONT_FAKE_MONOTONIC=1 libfaketime makes time.sleep() fail with EINVAL).
                celery = [self.faketime, "-f", skew, *celery]
            log = self.logs / f"{name}.log"
            offset = log.stat().st_size if log.exists() else 0
            child = self.procs.start(name, celery, env)
            self.workers[name] = child
            started.append((child, offset))
        for child, offset in started:
            child.wait_for_log("ready.", 90, after=offset)
        return [child for child, _ in started]

    def stop_workers(self, names: tuple[str, ...], *, kill: bool = False) -> None:
        """Warm shutdown (or SIGKILL) of workers ``names``, side by side."""
        children = [self.workers.pop(name) for name in names]
        for child in children:
            if kill:
                child.kill()
            else:
                child.terminate()
        for child in children:
            child.stop(grace=self.p.lease * 2)
            self.procs.forget(child)

    def stop_worker(self, name: str, *, kill: bool = False) -> None:
        """Warm shutdown (or SIGKILL) of worker ``name``."""
        self.stop_workers((name,), kill=kill)

    def start_beat(self) -> None:
        """Start celery beat (never skewed: the schedule's clock is the reference)."""
        argv = [sys.executable, "-m", "celery", "-A", "chaos.app", "beat", "-l", "INFO"]
        argv += ["-s", str(self.state_dir / "beat-schedule"), "--pidfile", str(self.state_dir / "beat.pid")]
        argv += ["--max-interval", "1"]
        self.beat = self.procs.start("beat", argv, self._env())
        self.beat.wait_for_log("beat: Starting...", 60)

    def restart_workers(
        self,
        names: tuple[str, ...],
        *,
        dsns: dict[str, str] | None = None,
        skew: str | None = None,
        settings: str | None = None,
    ) -> None:
        """Warm-restart ``names`` with other DSNs or a shifted clock (``None``: the normal ones)."""
        self.stop_workers(names)
        self.start_workers(names, dsns=dsns, skew=skew, settings=settings)

    # -- database ----------------------------------------------------------------------------

    def query(
        self, text: str, params: list[Any] | None = None, *, database: str = DATABASES[0]
    ) -> list[tuple[Any, ...]]:
        """Run a read-only query of the run's own in ``database``, retried while it is away."""
        deadline = time.monotonic() + 60
        while True:
            try:
                with connect(self.pg.dsns[database]) as conn:
                    return conn.execute(text, params).fetchall()
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def counts(self, database: str) -> dict[str, int]:
        """Rows per status in ``database``."""
        rows = self.query("SELECT status, count(*) FROM outbox GROUP BY 1", database=database)
        return {s: int(n) for s, n in rows}

    def claimable(self, database: str) -> int:
        """Pending rows of ``database`` a claim could take right now (not waiting out a backoff or
        a delay)."""
        rows = self.query(
            "SELECT count(*) FROM outbox WHERE status = 'pending' AND available_at <= now()",
            database=database,
        )
        return int(rows[0][0])

    def done(self, database: str) -> int:
        """Rows of ``database`` done so far."""
        return self.counts(database).get("done", 0)

    def ensure_autovacuum(self) -> str:
        """Autovacuum on, as on any production server (the pinned horizon fault needs it).

        On the run's own (embedded) server it is turned on if it was off; an external server
        is only reported.
        """
        state = str(self.query("SHOW autovacuum")[0][0])
        if state == "on":
            return "on"
        if not self.pg.restartable:
            return f"{state} (external server, left as it is)"
        with connect(self.pg.dsn) as conn:
            conn.execute("ALTER SYSTEM SET autovacuum = on")
            conn.execute("SELECT pg_reload_conf()")
        time.sleep(0.5)
        return f"{self.query('SHOW autovacuum')[0][0]} (was {state}: turned on for this run)"

    # -- faults ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def fault(self, name: str, *, window: bool = False) -> Iterator[FaultRecord]:
        """Record fault ``name``: its start, length and the rows delivered meanwhile.

        With ``window`` the workers stay up throughout, so a database where nothing was delivered
        while rows were claimable at its start (pending, not waiting out a backoff or delay) is
        stalled: a violation.
        """
        record = FaultRecord(name, time.monotonic() - self.start, time.strftime("%H:%M:%S", time.gmtime()))
        before = {db: self.done(db) for db in DATABASES}
        claimable = {db: self.claimable(db) if window else 0 for db in DATABASES}
        _log(self.start, f"fault {name} ...")
        began = time.monotonic()
        try:
            yield record
        except (OSError, RuntimeError, TimeoutError, psycopg.Error) as exc:
            record.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        record.seconds = time.monotonic() - began
        record.by_database = {db: self.done(db) - before[db] for db in DATABASES}
        record.delivered = sum(record.by_database.values())
        stalled = [
            f"database {db} stalled: 0 delivered with {claimable[db]} claimable"
            for db in DATABASES
            if window and record.by_database[db] == 0 and claimable[db] > 0
        ]
        if stalled:
            record.error = "; ".join([*([record.error] if record.error else []), *stalled])
        _log(
            self.start,
            f"fault {name}: {record.detail} delivered={record.delivered} {record.by_database} "
            f"{record.error or ''}",
        )
        self.faults.append(record)

    def skip(self, name: str, reason: str) -> None:
        """Record that fault ``name`` was not injected, and why."""
        clock = time.strftime("%H:%M:%S", time.gmtime())
        self.faults.append(FaultRecord(name, time.monotonic() - self.start, clock, skipped=reason))
        _log(self.start, f"fault {name} SKIPPED: {reason}")

    def f_child_kills(self) -> None:
        with self.fault("child_kills") as f:
            killed = 0
            for _ in range(self.p.child_kills):
                name = self.rng.choice(DELIVERY_WORKERS)
                pids = child_pids(self.workers[name].pid)
                if pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.rng.choice(pids), signal.SIGKILL)
                        killed += 1
                time.sleep(1.5)
            f.detail = f"SIGKILLed {killed} prefork children"
            time.sleep(self.p.settle)

    def _kill_periodically(self) -> None:
        """Beside the faults, from the first message to the end of the drain: SIGKILL one prefork
        child of a random delivery worker every ``kill_every`` seconds (``--kill-every``)."""
        rng = random.Random(self.seed + 1)
        while not self._stop_kills.wait(self.p.kill_every):
            worker = self.workers.get(rng.choice(DELIVERY_WORKERS))
            pids = child_pids(worker.pid) if worker is not None else []
            if pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rng.choice(pids), signal.SIGKILL)
                    self.periodic_kills += 1

    def f_worker_kill(self) -> None:
        with self.fault("worker_kill") as f:
            self.stop_worker("w1", kill=True)
            time.sleep(1.0)
            self.start_worker("w1")
            f.detail = "SIGKILL of worker w1's whole process group, restarted"
            time.sleep(self.p.settle)

    def f_broker_restart(self) -> None:
        with self.fault("broker_restart") as f:
            self.redis.kill()
            time.sleep(2.0)
            self.redis.start()
            f.detail = "redis-server SIGKILLed, 2 s down, restarted empty"
            time.sleep(self.p.settle * 2)

    def f_broker_flush(self) -> None:
        with self.fault("broker_flush") as f:
            self.redis.flush()
            f.detail = "FLUSHALL"
            time.sleep(self.p.settle)

    def f_deploy_outage(self) -> None:
        with self.fault("deploy_outage") as f:
            down = self.p.outage_leases * self.p.lease
            self.stop_workers(DELIVERY_WORKERS)
            time.sleep(down)
            self.start_workers(DELIVERY_WORKERS)
            f.detail = (
                f"every delivery worker down {down:.0f} s ({self.p.outage_leases:g} leases), claims running"
            )
            time.sleep(self.p.settle * 2)

    def f_backend_kills(self) -> None:
        with self.fault("backend_kills") as f:
            killed = []
            for _ in range(self.p.backend_kills):
                killed.append(self.pg.terminate_backends())
                time.sleep(1.0)
            f.detail = f"pg_terminate_backend of the workers' sessions: {'+'.join(map(str, killed))}"
            time.sleep(self.p.settle)

    def f_database_outage(self) -> None:
        """One database refuses every connection for a while (``ALLOW_CONNECTIONS false``), its
        sessions terminated, then is allowed again. Its rows wait; the other database must keep
        delivering meanwhile (a database that is down delays only its own rows, DESIGN invariant
        34), and the end check wants every row of both delivered."""
        down = OUTAGE_DATABASE
        others = [db for db in DATABASES if db != down]
        with self.fault("database_outage") as f:
            seconds = self.p.outage_leases * self.p.lease
            before = {db: self.done(db) for db in others}
            claimable = {db: self.claimable(db) for db in others}
            self.pg.allow_connections(down, False)
            try:
                killed = self.pg.terminate_database(down)
                time.sleep(seconds)
                during = {db: self.done(db) - before[db] for db in others}
            finally:
                self.pg.allow_connections(down, True)
            back = time.monotonic()
            at_back = {db: self.done(db) for db in [*others, down]}
            resumed: float | None = None
            while time.monotonic() - back < RESUME_WAIT:
                if self.done(down) > at_back[down]:
                    resumed = time.monotonic() - back
                    break
                time.sleep(0.2)
            # As long again after the outage (and at least the settle time): what the others
            # deliver with every database up, beside what they delivered while one was away.
            time.sleep(max(0.0, max(seconds, self.p.settle * 2) - (time.monotonic() - back)))
            after = {db: self.done(db) - at_back[db] for db in others}
            f.detail = (
                f"database {down} refused connections {seconds:.0f} s ({self.p.outage_leases:g} leases), "
                f"{killed} sessions terminated; meanwhile "
                + ", ".join(f"{db} delivered {n} ({after[db]} in as long after)" for db, n in during.items())
                + f"; {down} delivering again "
                + (f"{resumed:.1f} s after" if resumed is not None else f"NOT within {RESUME_WAIT:g} s")
            )
            stalled = [
                f"database {db} stalled while {down} was down: 0 delivered with {claimable[db]} claimable"
                for db in others
                if during[db] == 0 and claimable[db] > 0
            ]
            if stalled:
                f.error = "; ".join(stalled)

    def dead_tuples(self, database: str) -> int:
        """The outbox table's dead tuples in ``database`` (``pg_stat_user_tables.n_dead_tup``)."""
        rows = self.query(
            "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = 'outbox'::regclass", database=database
        )
        return int(rows[0][0]) if rows else 0

    def holds_xmin(self, pid: int) -> bool:
        """Whether backend ``pid`` holds back the xmin horizon (``backend_xmin`` set)."""
        with connect(self.pg.admin_dsn) as conn:
            row = conn.execute(
                "SELECT backend_xmin IS NOT NULL FROM pg_stat_activity WHERE pid = %s", [pid]
            ).fetchone()
        return bool(row and row[0])

    def f_pinned_horizon(self) -> None:
        # A session that took a REPEATABLE READ snapshot and sits idle in its transaction holds
        # the xmin horizon of its database (another database's vacuum ignores it): one such
        # session in each. Workers stay up, so a window with claimable rows and nothing
        # delivered is a stall.
        with self.fault("pinned_horizon", window=True) as f:
            hold = self.p.pin_leases * self.p.lease
            dead_before = {db: self.dead_tuples(db) for db in DATABASES}
            pins: list[psycopg.Connection[Any]] = []
            try:
                for db in DATABASES:
                    pin = psycopg.connect(self.pg.dsns[db], application_name=CONTROL_APP, connect_timeout=5)
                    pins.append(pin)
                    pin.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
                    pin.execute("SELECT pg_current_snapshot()")
                    if not self.holds_xmin(pin.info.backend_pid):
                        raise RuntimeError(f"the pinned transaction in {db} holds no backend_xmin")
                time.sleep(hold)
                for db, pin in zip(DATABASES, pins, strict=True):
                    if not self.holds_xmin(pin.info.backend_pid):
                        raise RuntimeError(
                            f"the pinned transaction in {db} lost its backend_xmin before the end"
                        )
                dead_pinned = {db: self.dead_tuples(db) for db in DATABASES}
                unfinished = sum(
                    v
                    for db in DATABASES
                    for k, v in self.counts(db).items()
                    if k in ("pending", "processing")
                )
            finally:
                for pin in pins:
                    with contextlib.suppress(psycopg.Error):
                        pin.rollback()
                    pin.close()
            f.detail = (
                f"REPEATABLE READ snapshot held {hold:.0f} s ({self.p.pin_leases:g} leases) in each "
                "database; outbox dead tuples "
                + ", ".join(f"{db} {dead_before[db]:,} -> {dead_pinned[db]:,}" for db in DATABASES)
                + f"; {unfinished} unfinished at its end"
            )
            time.sleep(self.p.settle * 2)

    def f_pg_restart(self) -> None:
        if not self.pg.restartable:
            self.skip("pg_restart", "external --dsn: the run does not own the server")
            return
        with self.fault("pg_restart") as f:
            self.pg.stop()
            time.sleep(3.0)
            self.pg.start()
            f.detail = "embedded PostgreSQL fast shutdown, 3 s down, started"
            time.sleep(self.p.settle * 2)

    def _clock(self, name: str, skew: str) -> None:
        if self.faketime is None:
            self.skip(name, "faketime not installed (Debian package faketime)")
            return
        # Restart first, then measure: the window counts deliveries by skewed workers only.
        self.restart_workers(("claim", *DELIVERY_WORKERS), skew=skew)
        self.altered = True
        with self.fault(name, window=True) as f:
            time.sleep(self.p.window_leases * self.p.lease)
            f.detail = f"claim and delivery workers at {skew} for {self.p.window_leases:g} leases"

    def f_clock_ahead(self) -> None:
        self._clock("clock_ahead", "+5s")

    def f_clock_behind(self) -> None:
        self._clock("clock_behind", "-5s")

    def f_pgbouncer(self) -> None:
        if PgBouncer.available() is None:
            self.skip("pgbouncer", "pgbouncer not installed (Debian package pgbouncer)")
            return
        self.bouncer = PgBouncer(self.procs, self.state_dir / "pgbouncer", self.pg.dsns)
        self.bouncer.start()
        self.restart_workers(
            ("claim", *DELIVERY_WORKERS), dsns=self.bouncer.dsns, settings=PGBOUNCER_SETTINGS
        )
        self.altered = True
        with self.fault("pgbouncer", window=True) as f:
            time.sleep(self.p.window_leases * self.p.lease)
            leases = self.p.window_leases
            f.detail = f"every worker through pgbouncer (transaction pooling) for {leases:g} leases"

    def ensure_normal(self) -> None:
        """Workers back on the real clock and the direct DSN after the window faults."""
        if self.altered:
            self.restart_workers(("claim", *DELIVERY_WORKERS))
            self.altered = False
        if self.bouncer is not None:
            self.bouncer.stop()
            self.bouncer = None

    def write_early(self, events: list[Any]) -> None:
        """Write ``events`` (``chaos.late``), each into the database its payload names, before
        any worker started: no table has a subscription of their type yet, so each is one bare
        row (DESIGN invariant 28)."""
        for db in DATABASES:
            with connect(self.pg.dsns[db]) as conn:
                live = subscriptions.list_subscriptions(conn, "outbox", event_type="chaos.late")
                if live:
                    raise RuntimeError(
                        f"chaos.late has subscriptions in {db} before any worker started: {live}"
                    )
                with conn.transaction():
                    enqueue_many(conn, for_database(events, db))
        self.early_bare = self.bare_late()
        if self.early_bare != len(events):
            raise RuntimeError(f"{len(events)} early chaos.late events written, {self.early_bare} bare rows")

    def bare_late(self) -> int:
        """Rows of ``chaos.late`` without a subscription's name (bare), every database."""
        return sum(
            int(self.query("SELECT count(*) FROM outbox WHERE event_type = 'chaos.late'", database=db)[0][0])
            for db in DATABASES
        )

    def wait_fanned_out(self, began: float) -> None:
        """Wait until the first claims fanned the bare ``chaos.late`` rows out, at most
        FAN_OUT_WAIT seconds from now (every worker ready); the time is counted from ``began``,
        when the workers were started."""
        deadline = time.monotonic() + FAN_OUT_WAIT
        while True:
            if self.bare_late() == 0:
                self.early_fanned_in = time.monotonic() - began
                return
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)

    def fanned_logged(self) -> tuple[int, int]:
        """(claims that fanned bare rows out, rows they fanned out), from every process's log."""
        found = [
            int(n)
            for log in sorted(self.logs.glob("*.log"))
            for n in FANNED_LOG.findall(log.read_text(errors="replace"))
        ]
        return len(found), sum(found)

    def claim_runs(self, last: int = 40) -> str:
        """What stopped the last claim runs, from the claim worker's log.

        The first thing to look at when the outbox stopped (``in_flight_bound``...).
        """
        log = self.logs / "claim.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        reasons = re.findall(r"'stopped_by': '(\w+)'", text)[-last:]
        if not reasons:
            return "none logged"
        counts = Counter(reasons).most_common()
        return f"last {len(reasons)} stopped by " + ", ".join(f"{r} {n}" for r, n in counts)

    # -- the run -----------------------------------------------------------------------------

    def planned_seconds(self, faults: list[str]) -> float:
        """Roughly how long the fault schedule takes (the producer spreads messages over it)."""
        p = self.p
        cost = {
            "child_kills": p.child_kills * 1.5 + p.settle,
            "worker_kill": 4 + p.settle,
            "broker_restart": 3 + p.settle * 2,
            "broker_flush": p.settle,
            "deploy_outage": p.outage_leases * p.lease + 6 + p.settle * 2,
            "backend_kills": p.backend_kills + p.settle,
            "database_outage": p.outage_leases * p.lease + max(p.outage_leases * p.lease, p.settle * 2) + 1,
            "pinned_horizon": p.pin_leases * p.lease + p.settle * 2,
            "pg_restart": 5 + p.settle * 2,
            "clock_ahead": p.window_leases * p.lease + 8,
            "clock_behind": p.window_leases * p.lease + 8,
            "pgbouncer": p.window_leases * p.lease + 8,
        }
        return 5 + sum(cost[f] for f in faults)

    def execute(self, faults: list[str]) -> tuple[Report, list[tuple[str, str]]]:
        """Start everything, inject ``faults`` while messages flow, drain, check each database."""
        self.redis.start()
        for db in DATABASES:
            with connect(self.pg.dsns[db]) as conn:
                migrate(conn)
                conn.execute(EFFECTS_DDL)
                # The subscriptions of chaos.fanout exist before the first event (invariant 28),
                # as a deploy's migrate step would add them; the workers add them too at start-up.
                subscriptions.register(conn, "outbox", [f"chaos.fanout@{name}" for name in FANOUT])
        # Those of chaos.late are not: its first events are written before any worker (which
        # registers them at start-up) and are bare rows until a claim fans them out.
        early = plan_early(self.p.early, self.p.keys, self.p.messages)
        self.write_early(early)
        self.autovacuum = self.ensure_autovacuum()
        self.start_beat()
        began = time.monotonic()
        self.start_workers(("claim", *DELIVERY_WORKERS))
        self.wait_fanned_out(began)
        seconds = self.planned_seconds(faults)
        events = plan(self.p.messages, self.p.keys, self.seed, self.p.slow_max)
        groups = plan_groups(self.p.groups, self.p.group_size)
        # One producer per database, each writing its share over the same time: a database that
        # is down holds back its own producer only.
        producers = [
            Producer(
                db,
                self.pg.dsns[db],
                for_database(events, db),
                seconds * 0.9,
                groups=[g for g in groups if g[1].payload["db"] == db],
            )
            for db in DATABASES
        ]
        self.start = time.monotonic()
        _log(
            self.start,
            f"producing {len(events)} messages into {len(DATABASES)} databases over ~{seconds * 0.9:.0f} s; "
            f"faults: {', '.join(faults)}",
        )
        for producer in producers:
            producer.start()
        killer = threading.Thread(target=self._kill_periodically, name="periodic-kills", daemon=True)
        if self.p.kill_every > 0:
            killer.start()
        try:
            time.sleep(5)
            for name in faults:
                try:
                    if name not in WINDOW_FAULTS:
                        self.ensure_normal()
                    getattr(self, f"f_{name}")()
                except (OSError, RuntimeError, TimeoutError, psycopg.Error) as exc:
                    # Could not inject it (a worker that never came back is a finding too).
                    clock = time.strftime("%H:%M:%S", time.gmtime())
                    text = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    self.faults.append(FaultRecord(name, time.monotonic() - self.start, clock, error=text))
                    _log(self.start, f"fault {name} FAILED: {text}")
            self.ensure_normal()
            while not all(producer.done for producer in producers):
                time.sleep(0.5)
            drain_start = time.monotonic()
            _log(self.start, "all produced and injected; draining")
            drained: float | None = None
            last = 0.0
            while time.monotonic() - drain_start < self.p.drain_timeout:
                counts = {db: self.counts(db) for db in DATABASES}
                if all(c.get("pending", 0) + c.get("processing", 0) == 0 for c in counts.values()):
                    drained = time.monotonic() - drain_start
                    break
                if time.monotonic() - last > 10:
                    _log(self.start, f"draining: {counts}")
                    last = time.monotonic()
                time.sleep(1.0)
        finally:
            self._stop_kills.set()
            for producer in producers:
                producer.stop()
        total = time.monotonic() - self.start
        report = self.judge(events, early, groups)
        if early and self.early_fanned_in is None:
            report.violations.append(
                f"bare chaos.late rows not all fanned out {FAN_OUT_WAIT:g} s after the workers were ready"
            )
        for f in self.faults:
            if f.error:
                report.violations.append(f"fault {f.name}: {f.error}")
        rows = {db: v.rows for db, v in report.databases.items()}
        facts = [
            (
                "messages",
                f"{sum(rows.values())} rows ("
                + ", ".join(f"{db} {n}" for db, n in rows.items())
                + f"; {len(events)} planned, {len(early)} before the workers, "
                + f"{sum(p.failures for p in producers)} producer retries)",
            ),
            (
                "profile",
                f"lease {self.p.lease:g} s, claim every {self.p.claim_interval:g} s, seed {self.seed}",
            ),
            (
                "databases",
                "; ".join(f"{db}: {redact(dsn)}" for db, dsn in self.pg.dsns.items())
                + ("" if self.pg.restartable else " (external)"),
            ),
            ("run time", f"{total:.0f} s"),
            (
                "drain time",
                f"{drained:.1f} s"
                if drained is not None
                else f"NOT DRAINED within {self.p.drain_timeout:.0f} s",
            ),
            ("autovacuum", self.autovacuum),
            (
                "periodic kills",
                f"{self.periodic_kills} prefork children SIGKILLed, one every {self.p.kill_every:g} s"
                if self.p.kill_every > 0
                else "off (--kill-every)",
            ),
            (
                "duplicates",
                ", ".join(f"{db} {v.duplicates}" for db, v in report.databases.items()),
            ),
            (
                "groups",
                f"{len(groups)} planned x {self.p.group_size}: "
                + "; ".join(
                    f"{db} {v.groups}, {len(v.groups_not_fired)} not fired, "
                    f"{len(v.callbacks_wrong)} callbacks not once"
                    for db, v in report.databases.items()
                ),
            ),
            (
                "late events",
                f"{len(early)} chaos.late written before any worker registered its subscriptions "
                f"({self.early_bare} bare rows, "
                + ", ".join(f"{db} {len(for_database(early, db))}" for db in DATABASES)
                + "), fanned out "
                + (
                    f"within {self.early_fanned_in:.1f} s of the workers' start"
                    if self.early_fanned_in is not None
                    else f"NOT ALL, {FAN_OUT_WAIT:g} s after the workers were ready"
                )
                + "; claims logged {} fan-out(s) of {} row(s)".format(*self.fanned_logged()),
            ),
            ("last claim runs", self.claim_runs()),
            ("logs", str(self.logs)),
        ]
        return report, facts

    def judge(self, events: list[Any], early: list[Any], groups: list[Any]) -> Report:
        """Every check, database by database: its rows against the handler runs recorded in it,
        and the runs recorded in another database than their event's."""
        sightings = load_seen(self.seen)
        by_db, misplaced = split_seen(sightings, DATABASES)
        report = Report(handler_runs=len(sightings), misplaced=misplaced)
        if misplaced:
            report.violations.append(
                f"{len(misplaced)} handler run(s) in another database than their event was written to"
            )
        for db in DATABASES:
            rows = self.query(
                "SELECT id, event_type, status, ordering_key, last_error FROM outbox ORDER BY id", database=db
            )
            effects = self.query(
                "SELECT outbox_id, count(*) FROM chaos_effects GROUP BY outbox_id", database=db
            )
            verdict = check([tuple(r) for r in rows], by_db[db], effects={int(i): int(n) for i, n in effects})
            made = self.query("SELECT id, state, callback_id FROM outbox_group ORDER BY id", database=db)
            # A callback's row holds its payload; a fanned-out one's other rows read it (payload_of).
            callbacks = self.query(
                "SELECT id, (payload -> 'outbox_group' ->> 'id')::bigint FROM outbox"
                " WHERE split_part(event_type, '@', 1) IN ('chaos.group_done', 'chaos.group_fan')"
                " AND payload_of IS NULL ORDER BY id",
                database=db,
            )
            check_groups(verdict, [tuple(r) for r in made], [(int(i), int(g)) for i, g in callbacks])
            fanned = self.query(
                "SELECT id, event_type, payload_of, status, payload ->> 'n' FROM outbox"
                " WHERE split_part(event_type, '@', 1) = ANY(%s) ORDER BY id",
                [[f"chaos.{kind}" for kind in SUBSCRIBED]],
                database=db,
            )
            planned: dict[str, set[int]] = {kind: set() for kind in SUBSCRIBED}
            for event in for_database([*events, *early, *(then for _, then in groups)], db):
                kind = event.event_type.removeprefix("chaos.")
                if kind in planned:
                    planned[kind].add(int(event.payload["n"]))
            check_subscribed(verdict, [tuple(r) for r in fanned], planned)
            # Every row holds the database its producer wrote it to (a fanned-out row reads its
            # event's payload): a row of another database's event is one in the wrong table.
            strays = self.query(
                "SELECT count(*) FROM outbox o LEFT JOIN outbox p ON p.id = o.payload_of"
                " WHERE coalesce(p.payload, o.payload) ->> 'db' IS DISTINCT FROM %s",
                [db],
                database=db,
            )
            if int(strays[0][0]):
                verdict.violations.append(f"{strays[0][0]} row(s) of another database's events")
            report.databases[db] = verdict
        return report


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m chaos", description="The outbox's chaos suite (docs/chaos.md)."
    )
    p.add_argument("--short", action="store_true", help="the CI variant: fewer messages, shorter faults")
    p.add_argument("--dsn", default=None, help="PostgreSQL server to use (a fresh database is created on it)")
    p.add_argument("--messages", type=int, default=None, help="override the profile's message count")
    p.add_argument(
        "--groups", type=int, default=None, help="override the profile's groups with a callback (0: none)"
    )
    p.add_argument(
        "--early",
        type=int,
        default=None,
        help="override the profile's chaos.late events written before any worker (0: none)",
    )
    p.add_argument(
        "--faults", default=",".join(FAULTS), help=f"comma-separated subset of: {', '.join(FAULTS)}"
    )
    p.add_argument(
        "--kill-every",
        type=float,
        default=None,
        metavar="SECONDS",
        help="also SIGKILL a delivery worker's prefork child every SECONDS until drained (default: never)",
    )
    p.add_argument("--seed", type=int, default=1, help="workload and fault seed (default 1)")
    p.add_argument(
        "--state-dir", default=str(ROOT / ".chaos"), help="logs, embedded PostgreSQL (default .chaos/)"
    )
    args = p.parse_args(argv)
    unknown = set(args.faults.split(",")) - set(FAULTS) - {""}
    if unknown:
        p.error(f"unknown fault(s): {', '.join(sorted(unknown))}")
    return args


def _on_signal(signum: int, frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    """Run the suite; 0 when every check passed, 1 on a violation, 2 if the run could not run."""
    args = _parse(argv)
    profile = SHORT if args.short else FULL
    if args.messages:
        profile = replace(profile, messages=args.messages)
    if args.groups is not None:
        profile = replace(profile, groups=args.groups)
    if args.kill_every is not None:
        profile = replace(profile, kill_every=args.kill_every)
    if args.early is not None:
        profile = replace(profile, early=args.early)
    faults = [f for f in FAULTS if f in args.faults.split(",")]
    state_dir = Path(args.state_dir).resolve()
    run_dir = state_dir / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, _on_signal)
    dsn: str | None = args.dsn or None
    report: Report | None = None
    try:
        with Postgres.open(dsn, state_dir, DATABASES) as pg:
            run = Run(profile, pg, run_dir, args.seed)
            try:
                report, facts = run.execute(faults)
            finally:
                run.procs.stop_all()
            print()
            print(render(report, run.faults, facts), flush=True)
    except (KeyboardInterrupt, Interrupted):
        print("interrupted: every process was stopped", file=sys.stderr)
        return 130
    except (OSError, RuntimeError, TimeoutError, psycopg.Error) as exc:
        # Setting up (PostgreSQL, Redis, the first workers) failed: nothing to judge.
        print(f"chaos: the run could not start: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return 1 if report is None or report.all_violations() else 0
