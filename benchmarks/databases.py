"""One Outbox serving many databases (``databases=``, DESIGN invariant 34): latency, idle cost,
connections, an outage, fairness.

``python -m benchmarks.databases`` (``--help`` for every option; ``--short`` for a smoke run of
about three minutes; also ``python -m benchmarks --only databases``) creates ``--databases``
(100) databases on one PostgreSQL server (``CREATE DATABASE``, each migrated with its
``outbox`` table) and runs the README deployment against them: one prefork worker consuming
the claim and the delivery queue (``--concurrency`` 2, prefetch 1; its main process runs one
LISTEN thread per database), one beat, Redis as the broker. The Outbox is declared with
``databases={name: DSN, ...}`` and the library's defaults (``--lease``, ``--idle-sweep``,
``--database-idle-close``, ``--claim-interval`` override them). A producer process commits one
event per transaction per database at a steady rate (``benchmarks.roles databases``), the
handler notes its start; commit -> handler start is ``time.time()`` at the handler's start
minus ``time.time()`` right after the producer's commit returned (one machine, one clock, as
the latency and horizon benchmarks measure it).

The server: a private cluster of the installed PostgreSQL (initdb on a free port, stock
settings: autovacuum on) with ``max_connections`` raised to what one LISTEN per database and
the worker's pools need (stock 100 is below one LISTEN per database at 100 databases) and
``pg_stat_statements`` loaded; else the embedded PostgreSQL 18; ``--dsn`` for another server.
The report's first line says which. Every figure is printed beside a baseline from the same
run: one database alone (``Outbox(dsn=...)``), at the same per-database rate, same deployment.

Each run starts the worker and beat, leaves them ``--settle`` seconds without load
(``idle_sweep + 5``: the listeners of the idle databases settle into their sweep, every process
has opened what it opens at its first claims; the baseline's 2 s), then produces for
``--warmup`` (10) seconds before the measured window of ``--seconds`` (60).

1. **load**: ``--active`` (20) of the databases produce ``--rate`` (10) msg/s each for
   ``--seconds`` (60); the others stay idle. Per active database p50/p99/max
   commit -> handler start (the worst database's p99, the median of the per-database p99s);
   the idle databases' cost: claim runs per idle database over the window (calls of the claim
   lock statement in ``pg_stat_statements``, else ``xact_commit`` deltas of
   ``pg_stat_database``; the sampler reads from the maintenance database, so none of it is the
   benchmark's) against ``seconds / idle_sweep`` per claiming process (the main process's
   listeners, and each pool process that ran beat's claim task), and their statements per sweep
   by query; how much of a pool process beat's claim tasks held; the worker's server
   connections (``application_name LIKE 'outbox-celery:%'`` in ``pg_stat_activity``, every
   second: max and median, by kind) beside the documented bound; the CPU of the worker's main
   process, of its pool processes and of the server over the window.
2. **outage** (``--down-seconds`` 60, 0 to skip), in the same run right after the load window:
   one active database made unavailable (``ALTER DATABASE ... WITH ALLOW_CONNECTIONS false``
   and ``pg_terminate_backend`` of its sessions), then given back: the other databases' p99
   during the outage beside before it (goal: within 20%) and the longest time no handler of
   theirs started (a pool process held by the stopped database); for the stopped database, every row
   delivered (its table all ``done``), and the seconds from its return to its last delivery
   (goal: within one lease).
3. **fairness**: the same databases, one at ``--hot-rate`` (500) msg/s beside ``--active - 1``
   at ``--quiet-rate`` (5): the quiet ones' p99 (goal <= 50 ms).

Goals printed beside the figures: p99 <= 50 ms on every active database (1, and the quiet ones
of 3); an idle database costs at most one statement per sweep per claiming process (its probe,
DESIGN invariant 36); connections within the bound. A short run on a shared machine: the load
average is printed with each run. ``--logs DIR`` keeps every run's worker, beat and producer
logs (the outage's warnings are also counted under its table).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import psycopg
from psycopg import sql

from outbox_celery import OutboxConfig, migrate
from outbox_celery.testing import embedded_redis, reachable, with_dbname

from .horizon import StockServer, stock_server
from .measure import cpu_seconds, last_json_line, percentile
from .pipeline import WORKER_FLAGS, cleanup_queues
from .procs import Proc, Processes, celery_command, wait_for
from .report import Report
from .services import LOCAL_REDIS, redact_url

__all__ = ["PARTS", "main", "parser", "run"]

#: The deployment's description with ``--claim-worker``.
CLAIM_WORKER = " and a claim worker of its own, solo"

PARTS = ("load", "outage", "fairness")
APP = "benchmarks.app_databases:app"
GOAL_P99 = 0.050
GOAL_OUTAGE_RATIO = 1.2
# The claim lock (queries.sql, claim_lock in claim_settings) is taken by the first statement of
# each claim transaction: once per claim run, unless the run claims several full batches.
_CLAIM_LOCK = "%pg_try_advisory_xact_lock(hashtextextended(%"

#: Option -> (full run, --short) defaults.
DEFAULTS: dict[str, tuple[Any, Any]] = {
    "databases": (100, 10),
    "active": (20, 3),
    "rate": (10.0, 10.0),
    "seconds": (60.0, 15.0),
    "down_seconds": (60.0, 10.0),
    "hot_rate": (500.0, 100.0),
    "quiet_rate": (5.0, 5.0),
    # The library's defaults in a full run (None: not given to the Outbox).
    "lease": (None, 20.0),
    "idle_sweep": (None, 5.0),
    "database_idle_close": (None, 10.0),
}


# -- the databases -----------------------------------------------------------------------------


@dataclass
class Fleet:
    """The benchmark's databases on one server: ``names`` (``d000``...) -> DSN, and the
    baseline's one database."""

    server: StockServer
    dsns: dict[str, str]
    datnames: dict[str, str]
    base_dsn: str
    base_datname: str
    setup_seconds: float = 0.0

    @property
    def names(self) -> list[str]:
        """The databases' names, in order."""
        return list(self.dsns)


def _create(server_dsn: str, datname: str) -> str:
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(datname)))
    dsn = with_dbname(server_dsn, datname)
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn, "outbox")
    return dsn


def _drop(server_dsn: str, datnames: Sequence[str]) -> None:
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        for name in datnames:
            with contextlib.suppress(psycopg.Error):
                admin.execute(
                    sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS true").format(sql.Identifier(name))
                )
                admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@contextlib.contextmanager
def fleet(server: StockServer, n: int, *, drop: bool = True) -> Iterator[Fleet]:
    """``n`` databases and the baseline's, created and migrated (four at a time); dropped after
    unless ``drop`` is false (a private server goes with them: a hundred drops take minutes)."""
    prefix = f"outbox_dbs_{uuid.uuid4().hex[:6]}"
    datnames = {f"d{i:03d}": f"{prefix}_{i:03d}" for i in range(n)}
    base = f"{prefix}_base"
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(4) as pool:
            futures = {name: pool.submit(_create, server.dsn, dat) for name, dat in datnames.items()}
            base_future = pool.submit(_create, server.dsn, base)
            dsns = {name: f.result() for name, f in futures.items()}
            base_dsn = base_future.result()
        yield Fleet(server, dsns, datnames, base_dsn, base, time.monotonic() - t0)
    finally:
        if drop:
            _drop(server.dsn, [*datnames.values(), base])


# -- one run -------------------------------------------------------------------------------------


@dataclass
class Plan:
    """One run of the README deployment: what it serves, who produces, for how long."""

    label: str
    #: ``databases=`` (name -> DSN), or ``None`` for the baseline's ``dsn=``.
    databases: dict[str, str] | None
    #: Producing databases: name -> (DSN, msg/s). The baseline's one database is named ``-``.
    rates: dict[str, tuple[str, float]]
    warmup: float
    seconds: float
    #: Seconds the worker and beat run without load before the producers start.
    settle: float = 2.0
    #: Made unavailable right after the window, for ``down_seconds`` (outage part).
    down: str | None = None
    down_datname: str = ""
    down_seconds: float = 0.0


@dataclass
class RunData:
    """What one run recorded (times are ``time.time()``)."""

    plan: Plan
    window: tuple[float, float] = (0.0, 0.0)
    down_at: float | None = None
    up_at: float | None = None
    #: When the producers were told to stop.
    load_end: float = 0.0
    #: The stopped database's highest id right before the outage.
    down_max_id: int = 0
    commits: dict[str, dict[int, float]] = field(default_factory=dict)
    starts: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    #: When a claim run published each row (its first publish), and which process published it.
    published: dict[str, dict[int, tuple[float, int]]] = field(default_factory=dict)
    worker_pid: int = 0
    #: The claim worker's (``--claim-worker``), whose publishes count as the main process's.
    claim_pid: int = 0
    #: (time, {kind: connections}) every second.
    connections: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    statements: tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]]] | None = None
    #: Calls per (database, statement) at the window's start and end (``pg_stat_statements``).
    queries: tuple[dict[tuple[str, str], int], dict[tuple[str, str], int]] | None = None
    xacts: tuple[dict[str, int], dict[str, int]] = ({}, {})
    claim_tasks: list[tuple[int, float]] = field(default_factory=list)
    #: (start, end) of each claim task that returned.
    claim_spans: list[tuple[float, float]] = field(default_factory=list)
    producer: dict[str, Any] = field(default_factory=dict)
    status: dict[str, dict[str, int]] = field(default_factory=dict)
    worker_warnings: dict[str, int] = field(default_factory=dict)
    load: tuple[float, float] = (0.0, 0.0)
    sampler_error: str | None = None
    #: CPU seconds over the window: the worker's main process, its pool processes, the server.
    cpu: dict[str, float | None] = field(default_factory=dict)
    #: Threads of the worker's main process at the window's end.
    main_threads: int = 0


def _stats_ok(conn: psycopg.Connection[Any]) -> bool:
    """Whether ``pg_stat_statements`` can be read here (created in the maintenance database)."""
    try:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        conn.execute("SELECT 1 FROM pg_stat_statements LIMIT 1")
        return True
    except psycopg.Error:
        return False


def _statements(conn: psycopg.Connection[Any]) -> dict[str, tuple[int, int]]:
    """Per database: (claim runs, every statement) from ``pg_stat_statements``."""
    rows = conn.execute(
        "SELECT d.datname, coalesce(sum(s.calls) FILTER (WHERE s.query LIKE %s), 0), sum(s.calls)"
        " FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid GROUP BY d.datname",
        [_CLAIM_LOCK],
    ).fetchall()
    return {str(d): (int(c), int(n)) for d, c, n in rows}


def _queries(conn: psycopg.Connection[Any]) -> dict[tuple[str, str], int]:
    """Per (database, statement's first words): calls, from ``pg_stat_statements``."""
    rows = conn.execute(
        "SELECT d.datname, s.query, s.calls FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid"
    ).fetchall()
    out: dict[tuple[str, str], int] = {}
    for dat, query, calls in rows:
        key = (str(dat), " ".join(str(query).split())[:70])
        out[key] = out.get(key, 0) + int(calls)
    return out


def _xacts(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """Per database: committed transactions (``pg_stat_database``, a fresh snapshot)."""
    conn.execute("SELECT pg_stat_clear_snapshot()")
    rows = conn.execute("SELECT datname, xact_commit FROM pg_stat_database WHERE datname IS NOT NULL")
    return {str(d): int(x) for d, x in rows.fetchall()}


class Sampler:
    """The worker's server connections every second, by kind, from the maintenance database."""

    def __init__(self, server_dsn: str, datnames: dict[str, str], active: set[str]) -> None:
        self.server_dsn = server_dsn
        self.kind = {dat: ("active" if name in active else "idle") for name, dat in datnames.items()}
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-databases-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with psycopg.connect(
                self.server_dsn, autocommit=True, application_name="bench-databases"
            ) as conn:
                while not self._stop.wait(1.0):
                    rows = conn.execute(
                        "SELECT datname, application_name, count(*) FROM pg_stat_activity"
                        " WHERE application_name LIKE 'outbox-celery:%%' AND datname = ANY(%s)"
                        " GROUP BY 1, 2",
                        [list(self.kind)],
                    ).fetchall()
                    counts = {"total": 0, "listen": 0, "start": 0, "pool active": 0, "pool idle": 0}
                    for dat, app, n in rows:
                        counts["total"] += n
                        if str(app).endswith(":listen"):
                            counts["listen"] += n
                        elif str(app).endswith(":start"):
                            counts["start"] += n
                        else:
                            counts[f"pool {self.kind[str(dat)]}"] += n
                    self.samples.append((time.time(), counts))
        except Exception as exc:  # the run goes on; the report says the sampler broke
            self.error = f"{type(exc).__name__}: {exc}"

    def stop(self) -> list[tuple[float, dict[str, int]]]:
        """Stop sampling; the samples."""
        self._stop.set()
        self._thread.join(10)
        return self.samples


def _unfinished(dsn: str, max_id: int | None = None) -> int:
    """Rows of ``dsn``'s outbox not ``done`` (up to ``max_id``); -1 when it cannot be read."""
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=2) as conn:
            row = conn.execute(
                "SELECT count(*) FROM outbox WHERE status <> 'done' AND (%s::bigint IS NULL OR id <= %s)",
                [max_id, max_id],
            ).fetchone()
        return int(row[0]) if row else 0
    except psycopg.Error:
        return -1


def _status(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {str(s): int(n) for s, n in conn.execute("SELECT status, count(*) FROM outbox GROUP BY 1")}


def _outage(server_dsn: str, datname: str, allow: bool) -> None:
    """Refuse (``allow`` false: and end every session of) or allow connections to ``datname``."""
    ident = sql.Identifier(datname)
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(
            sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS {}").format(ident, sql.SQL(str(allow)))
        )
        if allow:
            return
        for _ in range(100):
            row = admin.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = %s AND pid <> pg_backend_pid()",
                [datname],
            ).fetchone()
            if not row or not row[0]:
                return
            time.sleep(0.05)


def _sleep_until(t: float, watch: Sequence[Proc]) -> None:
    """Sleep until ``t`` (``time.time()``); fail early with its log's tail if a process exited."""
    while (left := t - time.time()) > 0:
        for p in watch:
            if not p.alive():
                raise RuntimeError(f"{p.name} exited early:\n{p.tail()}")
        time.sleep(min(left, 0.5))


def _cpu(
    worker: Proc, admin: psycopg.Connection[Any], claimer: Proc | None = None
) -> dict[str, float | None]:
    """CPU seconds so far: the worker's main process, its pool processes, the claim worker (when
    there is one) and the server's processes (the postmaster's children, when the server runs on
    this machine)."""
    tree = worker.tree()
    server: float | None = None
    row = admin.execute("SELECT pg_backend_pid()").fetchone()
    with contextlib.suppress(psutil.Error, TypeError):
        postmaster = psutil.Process(int(row[0]) if row else 0).parent()
        if postmaster is not None:
            server = cpu_seconds([postmaster, *postmaster.children(recursive=True)])
    out = {"main": cpu_seconds(tree[:1]), "pool": cpu_seconds(tree[1:]), "server": server}
    if claimer is not None:
        out["claim"] = cpu_seconds(claimer.tree())
    return out


def _delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


def _read_starts(folder: Path) -> dict[str, dict[int, list[float]]]:
    starts: dict[str, dict[int, list[float]]] = {}
    for path in sorted(folder.glob("start-*.txt")):
        for line in path.read_text().splitlines():
            db, i, t = line.split()
            starts.setdefault(db, {}).setdefault(int(i), []).append(float(t))
    return starts


def _read_published(folder: Path) -> dict[str, dict[int, tuple[float, int]]]:
    out: dict[str, dict[int, tuple[float, int]]] = {}
    for path in sorted(folder.glob("published-*.txt")):
        pid = int(path.stem.removeprefix("published-"))
        for line in path.read_text().splitlines():
            db, i, t = line.split()
            rows = out.setdefault(db, {})
            if int(i) not in rows or float(t) < rows[int(i)][0]:
                rows[int(i)] = (float(t), pid)
    return out


def _read_commits(folder: Path) -> dict[str, dict[int, float]]:
    commits: dict[str, dict[int, float]] = {}
    for path in folder.glob("commits-*.txt"):
        name = path.stem.removeprefix("commits-")
        commits[name] = {
            int(i): float(t) for i, t in (line.split() for line in path.read_text().splitlines())
        }
    return commits


def _warnings(log: Path) -> dict[str, int]:
    """The worker log's WARNING and ERROR lines, counted by their message's first words."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in log.read_text(errors="replace").splitlines():
            for level in ("WARNING/", "ERROR/", "CRITICAL/"):
                if level in line:
                    text = line.split("] ", 1)[-1]
                    key = " ".join(text.split()[:7])
                    out[key] = out.get(key, 0) + 1
                    break
    return out


@dataclass
class Runner:
    """Runs plans on one server and broker: the README deployment each time, fresh queues."""

    server_dsn: str
    redis_url: str
    workdir: Path
    concurrency: int
    settings: dict[str, Any]
    lease: float
    use_statements: bool
    #: Where each run's process logs are copied (``None``: they go with the temporary directory).
    logs: Path | None = None
    #: The claims in a worker of their own (``-Q <claim queue> -P solo -c 1``, docs/celery.md),
    #: the delivery worker consuming the delivery queue only.
    claim_worker: bool = False

    def run(self, plan: Plan, datnames: dict[str, str]) -> RunData:
        """One run: truncate, start the worker and beat, produce, measure, stop."""
        data = RunData(plan)
        tag = f"dbs-{uuid.uuid4().hex[:6]}"
        folder = self.workdir / tag
        folder.mkdir()
        queue, claim_queue = f"bench.deliver.{tag}", f"bench.claim.{tag}"
        for dsn, _ in plan.rates.values():
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("TRUNCATE outbox")
        env = {
            "BENCH_BROKER_URL": self.redis_url,
            "BENCH_QUEUE": queue,
            "BENCH_CLAIM_QUEUE": claim_queue,
            "BENCH_PREFETCH": "1",
            "BENCH_OUTBOX_SETTINGS": json.dumps(self.settings),
        }
        if plan.databases is not None:
            env["BENCH_DATABASES"] = json.dumps(plan.databases)
        else:
            env["BENCH_DSN"] = plan.rates["-"][0]
        worker_env = {
            **env,
            "BENCH_LATENCY_DIR": str(folder),
            "BENCH_CLAIM_LOG": str(folder / "claims.txt"),
            "BENCH_READY": str(folder / "ready"),
        }
        active = {name for name in plan.rates if name != "-"}
        data.load = (os.getloadavg()[0], 0.0)
        try:
            with Processes(folder) as procs, psycopg.connect(self.server_dsn, autocommit=True) as admin:
                args = [
                    "worker",
                    "-Q",
                    queue if self.claim_worker else f"{claim_queue},{queue}",
                    "-P",
                    "prefork",
                    "-c",
                    str(self.concurrency),
                ]
                worker = procs.start(
                    "worker",
                    celery_command(
                        APP, *args, "-n", f"{tag}@%h", *WORKER_FLAGS, "--prefetch-multiplier", "1"
                    ),
                    worker_env,
                )
                wait_for(folder / "ready", [worker], 180)
                data.worker_pid = worker.pid
                watch = [worker]
                claimer: Proc | None = None
                if self.claim_worker:
                    claimer = procs.start(
                        "claimer",
                        celery_command(
                            APP,
                            "worker",
                            "-Q",
                            claim_queue,
                            "-P",
                            "solo",
                            "-c",
                            "1",
                            "-n",
                            f"{tag}-claim@%h",
                            *WORKER_FLAGS,
                        ),
                        {**worker_env, "BENCH_READY": str(folder / "claim-ready")},
                    )
                    wait_for(folder / "claim-ready", [claimer], 180)
                    data.claim_pid = claimer.pid
                    watch.append(claimer)
                beat = procs.start(
                    "beat", celery_command(APP, "beat", "-s", str(folder / "beat"), "-l", "WARNING"), env
                )
                sampler = Sampler(self.server_dsn, datnames, active)
                watch.append(beat)
                _sleep_until(time.time() + plan.settle, watch)
                t0 = time.time() + 1.0
                producer = procs.start(
                    "producer",
                    [sys.executable, "-m", "benchmarks.roles", "databases"],
                    {
                        "BENCH_PRODUCE": json.dumps(
                            {n: {"dsn": d, "rate": r} for n, (d, r) in plan.rates.items()}
                        ),
                        "BENCH_T0": str(t0),
                        "BENCH_STOP": str(folder / "stop"),
                        "BENCH_LATENCY_DIR": str(folder),
                    },
                )
                watch.append(producer)

                def sleep_until(t: float) -> None:
                    _sleep_until(t, watch)

                start = t0 + plan.warmup
                sleep_until(start)
                s0 = _statements(admin) if self.use_statements else None
                q0 = _queries(admin) if self.use_statements else None
                x0 = _xacts(admin)
                cpu0 = _cpu(worker, admin, claimer)
                sleep_until(start + plan.seconds)
                s1 = _statements(admin) if self.use_statements else None
                q1 = _queries(admin) if self.use_statements else None
                x1 = _xacts(admin)
                cpu1 = _cpu(worker, admin, claimer)
                data.cpu = {k: _delta(cpu0[k], cpu1.get(k)) for k in cpu0}
                with contextlib.suppress(psutil.Error):
                    data.main_threads = psutil.Process(worker.pid).num_threads()
                data.window = (start, start + plan.seconds)
                data.statements = (s0, s1) if s0 is not None and s1 is not None else None
                data.queries = (q0, q1) if q0 is not None and q1 is not None else None
                data.xacts = (x0, x1)
                if plan.down is not None:
                    self._outage(plan, data, sleep_until)
                data.load_end = time.time()
                (folder / "stop").touch()
                producer.popen.wait(60)
                data.producer = last_json_line(producer.log)
                watch.remove(producer)
                # Everything committed is finished (a row whose task was lost in the outage
                # comes back after its lease).
                deadline = time.monotonic() + self.lease + 60
                dsns = [d for d, _ in plan.rates.values()]
                while any(_unfinished(d) != 0 for d in dsns) and time.monotonic() < deadline:
                    sleep_until(time.time() + 0.5)
                data.connections = sampler.stop()
                data.sampler_error = sampler.error
                data.status = {name: _status(d) for name, (d, _) in plan.rates.items()}
        finally:
            cleanup_queues(self.redis_url, [queue, claim_queue])
            if self.logs is not None:
                dest = self.logs / f"{plan.label.replace(' ', '-').replace('/', '')}-{tag}"
                dest.mkdir(parents=True, exist_ok=True)
                for log in folder.glob("*.log"):
                    shutil.copy2(log, dest / log.name)
            if plan.down is not None:
                with contextlib.suppress(psycopg.Error):
                    _outage(self.server_dsn, plan.down_datname, True)
        data.load = (data.load[0], os.getloadavg()[0])
        data.commits = _read_commits(folder)
        data.starts = _read_starts(folder)
        data.published = _read_published(folder)
        with contextlib.suppress(OSError):
            for line in (folder / "claims.txt").read_text().splitlines():
                pid, t = line.split()
                data.claim_tasks.append((int(pid), float(t)))
        with contextlib.suppress(OSError):
            for line in (folder / "claims.txt.done").read_text().splitlines():
                _, t0_, t1_ = line.split()
                data.claim_spans.append((float(t0_), float(t1_)))
        data.worker_warnings = _warnings(folder / "worker.log")
        return data

    def _outage(self, plan: Plan, data: RunData, sleep_until: Any) -> None:
        assert plan.down is not None
        dsn = plan.rates[plan.down][0]
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute("SELECT coalesce(max(id), 0) FROM outbox").fetchone()
        data.down_max_id = int(row[0]) if row else 0
        data.down_at = time.time()
        _outage(self.server_dsn, plan.down_datname, False)
        sleep_until(data.down_at + plan.down_seconds)
        _outage(self.server_dsn, plan.down_datname, True)
        data.up_at = time.time()
        # The load goes on until every row committed before the outage is done (at least
        # 10 s, at most a lease and 30 s): the others' latency after it is measured too.
        deadline = data.up_at + self.lease + 30
        while time.time() < deadline:
            if time.time() >= data.up_at + 10 and _unfinished(dsn, data.down_max_id) == 0:
                break
            sleep_until(time.time() + 0.5)


# -- figures -------------------------------------------------------------------------------------


@dataclass
class Lat:
    """Commit -> handler start of some messages (seconds)."""

    values: list[float]
    committed: int
    missing: int

    @property
    def p50(self) -> float:
        """Median."""
        return percentile(self.values, 0.5)

    @property
    def p99(self) -> float:
        """99th percentile."""
        return percentile(self.values, 0.99)

    @property
    def max(self) -> float:
        """Largest."""
        return self.values[-1] if self.values else math.nan


def latency(data: RunData, names: Sequence[str], lo: float, hi: float) -> Lat:
    """Commit -> first handler start of ``names``' messages committed in ``[lo, hi)``."""
    values: list[float] = []
    committed = missing = 0
    for name in names:
        starts = data.starts.get(name, {})
        for i, c in data.commits.get(name, {}).items():
            if lo <= c < hi:
                committed += 1
                if i in starts:
                    values.append(min(starts[i]) - c)
                else:
                    missing += 1
    return Lat(sorted(values), committed, missing)


@dataclass
class Legs:
    """Commit -> handler start cut at the publish: the claim's leg, the broker's and worker's."""

    claim: list[float]
    hop: list[float]
    #: Rows published by the worker's main process (its listeners) and by pool processes
    #: (beat's claim task).
    by_listeners: int
    by_claim_task: int

    def text(self) -> str:
        """``p99 claim / p99 hop`` in ms, and who published."""
        n = self.by_listeners + self.by_claim_task
        share = f"{self.by_claim_task / n:.0%}" if n else "-"
        return f"{_ms(percentile(self.claim, 0.99))} / {_ms(percentile(self.hop, 0.99))} ({share})"


def legs(data: RunData, names: Sequence[str], lo: float, hi: float) -> Legs:
    """The two legs of ``names``' messages committed in ``[lo, hi)`` that were published."""
    claim: list[float] = []
    hop: list[float] = []
    mine = theirs = 0
    for name in names:
        starts = data.starts.get(name, {})
        published = data.published.get(name, {})
        for i, c in data.commits.get(name, {}).items():
            if lo <= c < hi and i in published:
                t, pid = published[i]
                claim.append(t - c)
                if i in starts:
                    hop.append(min(starts[i]) - t)
                if pid in (data.worker_pid, data.claim_pid):
                    mine += 1
                else:
                    theirs += 1
    return Legs(sorted(claim), sorted(hop), mine, theirs)


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1000:.1f}"


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _per_db(data: RunData, names: Sequence[str]) -> dict[str, Lat]:
    lo, hi = data.window
    return {n: latency(data, [n], lo, hi) for n in names}


def _med(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def _window_samples(data: RunData, lo: float, hi: float) -> list[dict[str, int]]:
    return [c for t, c in data.connections if lo <= t < hi]


# -- the benchmark -------------------------------------------------------------------------------


@dataclass
class Bench:
    """The three parts and their baselines, on one fleet."""

    args: argparse.Namespace
    fleet: Fleet
    runner: Runner
    report: Report
    config: OutboxConfig
    results: dict[str, Any] = field(default_factory=dict)
    _baselines: dict[float, RunData] = field(default_factory=dict)

    def baseline(self, rate: float) -> RunData:
        """One database alone (``dsn=``) at ``rate`` (run once per rate)."""
        if rate not in self._baselines:
            a = self.args
            plan = Plan(
                f"baseline {rate:g}/s",
                None,
                {"-": (self.fleet.base_dsn, rate)},
                warmup=a.warmup,
                seconds=a.seconds,
                settle=a.baseline_settle,
            )
            data = self.runner.run(plan, {"-": self.fleet.base_datname})
            self._baselines[rate] = data
            lat = latency(data, ["-"], *data.window)
            self.results.setdefault("baselines", {})[f"{rate:g}"] = {
                "p50": lat.p50,
                "p99": lat.p99,
                "max": lat.max,
                "committed": lat.committed,
                "missing": lat.missing,
                "load": data.load,
                "connections_max": max((c["total"] for c in _window_samples(data, *data.window)), default=0),
            }
        return self._baselines[rate]

    def _active(self) -> list[str]:
        return self.fleet.names[: self.args.active]

    def load(self, outage: bool) -> None:
        """Parts 1 and 2: ``active`` databases at ``rate`` beside the idle rest, then the outage."""
        a = self.args
        names = self._active()
        down = names[0] if outage and a.down_seconds > 0 else None
        plan = Plan(
            "load",
            self.fleet.dsns,
            {n: (self.fleet.dsns[n], a.rate) for n in names},
            warmup=a.warmup,
            seconds=a.seconds,
            settle=a.settle,
            down=down,
            down_datname=self.fleet.datnames[down] if down else "",
            down_seconds=a.down_seconds,
        )
        data = self.runner.run(plan, self.fleet.datnames)
        base = self.baseline(a.rate)
        self._report_load(data, base, names)
        self._report_idle(data, names)
        self._report_connections(data, base, names)
        if down is not None:
            self._report_outage(data, names, down)

    def _report_load(self, data: RunData, base: RunData, names: list[str]) -> None:
        a = self.args
        per = _per_db(data, names)
        b = latency(base, ["-"], *base.window)
        p99s = {n: lat.p99 for n, lat in per.items()}
        worst = max(p99s, key=lambda n: p99s[n])
        over = [n for n, v in p99s.items() if not v <= GOAL_P99]
        t = self.report.table(
            f"1. {a.databases} databases, {a.active} producing {a.rate:g} msg/s each for {a.seconds:g} s, "
            f"{a.databases - a.active} idle: commit -> handler start, ms (README deployment, "
            f"prefork x{a.concurrency}{CLAIM_WORKER if a.claim_worker else ''}, Redis; "
            f"load average {data.load[0]:.2f} -> {data.load[1]:.2f})",
            ["figure", "value", f"baseline: one database (dsn=), {a.rate:g} msg/s", "goal"],
        )
        t.row("p50, median of the active databases", _ms(_med([x.p50 for x in per.values()])), _ms(b.p50), "")
        t.row(
            "p99, median of the per-database p99s",
            _ms(_med(list(p99s.values()))),
            _ms(b.p99),
            f"<= {GOAL_P99 * 1000:.0f}",
        )
        t.row(
            f"p99, worst database ({worst})",
            _ms(p99s[worst]),
            _ms(b.p99),
            f"<= {GOAL_P99 * 1000:.0f} on every one: {_met(not over)}"
            + (f" ({len(over)} over)" if over else ""),
        )
        t.row("max, worst database", _ms(max(x.max for x in per.values())), _ms(b.max), "")
        t.row(
            "p99 commit -> published / published -> start (share published by beat's claim task)",
            legs(data, names, *data.window).text(),
            legs(base, ["-"], *base.window).text(),
            "",
        )
        t.row(
            "beat's claim tasks in the window",
            _claim_busy(data, *data.window),
            _claim_busy(base, *base.window),
            "",
        )
        for row in _cpu_rows(data, base):
            t.row(*row, "")
        committed = sum(x.committed for x in per.values())
        missing = sum(x.missing for x in per.values())
        t.row(
            "messages in the window (never started)",
            f"{committed} ({missing})",
            f"{b.committed} ({b.missing})",
            "",
        )
        t.note(
            "per database p50/p99/max ms: "
            + ", ".join(f"{n} {_ms(x.p50)}/{_ms(x.p99)}/{_ms(x.max)}" for n, x in per.items())
        )
        t.note(
            f"window: commits from {a.warmup:g} s after the load started (warm-up) for {a.seconds:g} s; the "
            f"worker ran {a.settle:g} s without load first (the baseline {a.baseline_settle:g} s: no idle "
            "database to settle); "
            f"producer late commits (> 10 ms behind its pace): {_late(data)}, baseline {_late(base)}"
        )
        self.results["load"] = {
            "per_database": {
                n: {"p50": x.p50, "p99": x.p99, "max": x.max, "n": x.committed} for n, x in per.items()
            },
            "p99_median": _med(list(p99s.values())),
            "p99_worst": [worst, p99s[worst]],
            "baseline": {"p50": b.p50, "p99": b.p99, "max": b.max},
            "load": data.load,
        }

    def _report_idle(self, data: RunData, names: list[str]) -> None:
        a = self.args
        lo, hi = data.window
        idle = [n for n in self.fleet.names if n not in names]
        if not idle:
            return
        sweep = self.config.idle_sweep
        pids = sorted({pid for pid, t in data.claim_tasks if lo <= t < hi})
        processes = 1 + len(pids)
        per_process = a.seconds / sweep
        # Each process sweeps an idle database once per idle_sweep, at a moment of its own in each
        # period (invariant 35): a window not aligned with the periods touches one period more.
        allowed = processes * (math.ceil(per_process) + 1)
        dats = [self.fleet.datnames[n] for n in idle]
        t = self.report.table(
            f"1. The {len(idle)} idle databases' cost over the {a.seconds:g}-s window "
            f"(idle_sweep {sweep:g} s)",
            ["figure", "median", "max", "expected", "goal"],
        )
        out: dict[str, Any] = {"claiming_processes": processes, "claim_task_pids": len(pids)}
        if data.statements is not None:
            s0, s1 = data.statements
            claims = [s1.get(d, (0, 0))[0] - s0.get(d, (0, 0))[0] for d in dats]
            stmts = [s1.get(d, (0, 0))[1] - s0.get(d, (0, 0))[1] for d in dats]
            worst = max(claims)
            t.row(
                "claim runs per idle database (claim lock calls, pg_stat_statements)",
                f"{_med(claims):g}",
                f"{worst}",
                f"{per_process:g} sweeps per claiming process x {processes} = {per_process * processes:g}",
                "0: a sweep claims only what its probe finds (invariant 36)",
            )
            t.row(
                "statements per idle database (every one: BEGIN, COMMIT, next_due...)",
                f"{_med(stmts):g}",
                f"{max(stmts)}",
                f"{per_process * processes:g} (one per sweep each)",
                f"<= {allowed} (one query per sweep each): {_met(max(stmts) <= allowed)}",
            )
            sweeps = a.seconds / sweep
            t.row(
                "the same per idle_sweep: claim runs / statements",
                f"{_med(claims) / sweeps:.2f} / {_med(stmts) / sweeps:.1f}",
                f"{worst / sweeps:.2f} / {max(stmts) / sweeps:.1f}",
                f"statements: 1 per claiming process x {processes}",
                "",
            )
            out |= {"claims": claims, "statements": stmts}
            if data.queries is not None:
                q0, q1 = data.queries
                wanted = set(dats)
                calls: dict[str, int] = {}
                for (dat, query), n in q1.items():
                    if dat in wanted:
                        calls[query] = calls.get(query, 0) + n - q0.get((dat, query), 0)
                top = sorted(((n, q) for q, n in calls.items() if n > 0), reverse=True)[:8]
                t.note(
                    "statements per idle database per idle_sweep, most called first: "
                    + "; ".join(f"{n / len(dats) / sweeps:.2f} x '{q}'" for n, q in top)
                )
                out["statements_by_query"] = {q: n / len(dats) for n, q in top}
        x0, x1 = data.xacts
        xacts = [x1.get(d, 0) - x0.get(d, 0) for d in dats]
        t.row(
            "transactions per idle database (pg_stat_database.xact_commit)",
            f"{_med(xacts):g}",
            f"{max(xacts)}",
            "" if data.statements is not None else f"{per_process * processes:g} claims",
            ""
            if data.statements is not None
            else f"<= {allowed} claims: {_met(max(xacts) <= allowed)} (a claim"
            " run may take more than one transaction)",
        )
        out["xact_commit"] = xacts
        t.note(
            f"claiming processes: the worker's main process (one LISTEN thread per database, each claiming "
            f"its database) and {len(pids)} pool process(es) that ran beat's claim task in the window "
            f"({sum(1 for _, x in data.claim_tasks if lo <= x < hi)} claim tasks, claim_interval "
            f"{self.config.claim_interval:g} s); the sampler reads pg_stat_activity from the maintenance "
            "database, so none of the counts is the benchmark's own; xact_commit is flushed by each backend "
            "at most once a second (10 s when idle)"
        )
        self.results["idle"] = out

    def _bound(self, used: int) -> int:
        c = int(self.args.concurrency)
        return int(self.args.databases) + (c + 1) * self.config.pool_max_size * used

    def _report_connections(self, data: RunData, base: RunData, names: list[str]) -> None:
        a = self.args
        samples = _window_samples(data, *data.window)
        bsamples = _window_samples(base, *base.window)
        if not samples:
            self.report.text(f"connections: no sample ({data.sampler_error or 'none taken'})")
            return
        t = self.report.table(
            "1. Server connections of the worker (pg_stat_activity, application_name LIKE 'outbox-celery:%', "
            f"every second of the window; {a.databases} databases, {a.active} active)",
            ["kind", "max", "median", "baseline max (one database)", "bound"],
        )
        bound_all, bound_active = self._bound(a.databases), self._bound(a.active)
        tot = [s["total"] for s in samples]
        t.row(
            "total",
            f"{max(tot)}",
            f"{_med(tot):g}",
            f"{max((s['total'] for s in bsamples), default=0)}",
            f"{bound_all} ({_met(max(tot) <= bound_all)}); {bound_active} if only the active count as used "
            f"({_met(max(tot) <= bound_active)})",
        )
        for kind, bound in (
            ("listen", f"{a.databases} (one per database)"),
            ("pool active", f"{(a.concurrency + 1) * self.config.pool_max_size * a.active}"),
            ("pool idle", ""),
            ("start", ""),
        ):
            vals = [s[kind] for s in samples]
            t.row(
                kind,
                f"{max(vals)}",
                f"{_med(vals):g}",
                f"{max((s[kind] for s in bsamples), default=0)}",
                bound,
            )
        idle = a.databases - a.active
        if idle:
            vals = [s["pool idle"] / idle for s in samples]
            t.row("pool idle, per idle database", f"{max(vals):.2f}", f"{_med(vals):.2f}", "", "")
        t.note(
            f"bound (documented): one LISTEN per database in the claiming worker's main process, plus per "
            f"process with pools at most pool_max_size ({self.config.pool_max_size}) per database it used in "
            f"the last database_idle_close ({self.config.database_idle_close:g} s); processes with pools: "
            f"the {a.concurrency} pool processes and the main process (its listeners claim through pools): "
            f"{a.databases} + {a.concurrency + 1} x {self.config.pool_max_size} x used. An idle database is "
            f"claimed every idle_sweep ({self.config.idle_sweep:g} s), so it counts as used when "
            f"idle_sweep < database_idle_close"
        )
        self.results["connections"] = {
            "max": max(tot),
            "median": _med(tot),
            "by_kind_max": {k: max(s[k] for s in samples) for k in samples[0]},
            "bound_all_used": bound_all,
            "bound_active_used": bound_active,
        }

    def _report_outage(self, data: RunData, names: list[str], down: str) -> None:
        a = self.args
        assert data.down_at is not None and data.up_at is not None
        others = [n for n in names if n != down]
        before = latency(data, others, *data.window)
        during = latency(data, others, data.down_at, data.up_at)
        per_before = {n: latency(data, [n], *data.window).p99 for n in others}
        per_during = {n: latency(data, [n], data.down_at, data.up_at).p99 for n in others}
        worst_b = max(per_before, key=lambda n: per_before[n])
        worst_d = max(per_during, key=lambda n: per_during[n])
        ratio = during.p99 / before.p99 if before.p99 else math.nan
        t = self.report.table(
            f"2. Database {down} unavailable for {a.down_seconds:g} s (ALLOW_CONNECTIONS false, its sessions "
            f"terminated), right after the window of 1; the other {len(others)} at {a.rate:g} msg/s",
            ["figure", "during the outage", "baseline: before it (the window of 1)", "ratio", "goal"],
        )
        t.row(
            f"p99 of the other {len(others)} databases' messages, ms",
            _ms(during.p99),
            _ms(before.p99),
            f"{ratio:.2f}x",
            f"<= {GOAL_OUTAGE_RATIO:.1f}x: {_met(ratio <= GOAL_OUTAGE_RATIO)}"
            + (
                f" (not a comparison: the window before already missed p99 <= {GOAL_P99 * 1000:.0f})"
                if not before.p99 <= GOAL_P99
                else ""
            ),
        )
        t.row(
            "p50 of the others, ms", _ms(during.p50), _ms(before.p50), f"{during.p50 / before.p50:.2f}x", ""
        )
        t.row(
            "p99, worst other database, ms",
            f"{_ms(per_during[worst_d])} ({worst_d})",
            f"{_ms(per_before[worst_b])} ({worst_b})",
            "",
            "",
        )
        t.row("max of the others, ms", _ms(during.max), _ms(before.max), "", "")
        gap_d = _longest_gap(data, others, data.down_at, data.up_at)
        gap_b = _longest_gap(data, others, *data.window)
        t.row(
            "longest time without a handler start of any other database, s",
            f"{gap_d:.1f}",
            f"{gap_b:.1f}",
            "",
            "",
        )
        t.row(
            "others: p99 commit -> published / published -> start, ms (share by beat's claim task)",
            legs(data, others, data.down_at, data.up_at).text(),
            legs(data, others, *data.window).text(),
            "",
            "",
        )
        t.row(
            "beat's claim tasks",
            _claim_busy(data, data.down_at, data.up_at),
            _claim_busy(data, *data.window),
            "",
            "",
        )
        t.row(
            "others' messages (never started)",
            f"{during.committed} ({during.missing})",
            f"{before.committed} ({before.missing})",
            "",
            "",
        )
        # The stopped database.
        status = data.status.get(down, {})
        total = sum(status.values())
        done = status.get("done", 0)
        starts = data.starts.get(down, {})
        commits = data.commits.get(down, {})
        waited = [
            i for i, c in commits.items() if c < data.down_at and max(starts.get(i, [0.0])) >= data.down_at
        ]
        last = max(
            (max(starts[i]) for i, c in commits.items() if c < data.up_at and i in starts), default=math.nan
        )
        recovery = last - data.up_at
        twice = sum(1 for v in starts.values() if len(v) > 1)
        never = sum(1 for i in commits if i not in starts)
        t.row(
            f"{down}: rows done / in its table",
            f"{done} / {total}",
            "",
            "",
            f"all: {_met(done == total and never == 0)}"
            + (f" ({never} committed, never started)" if never else ""),
        )
        t.row(
            f"{down}: seconds from its return to its last delivery",
            f"{max(recovery, 0.0):.1f}" if not math.isnan(recovery) else "-",
            "",
            "",
            f"<= one lease ({self.config.lease:g} s): {_met(recovery <= self.config.lease)}",
        )
        t.row(
            f"{down}: rows committed before the outage, started after it began",
            f"{len(waited)}",
            "",
            "",
            "",
        )
        pdb = data.producer.get("databases", {}).get(down, {})
        t.note(
            f"{down}: {pdb.get('failed', '?')} commits refused while it was down; {twice} rows' handler ran "
            "more than once (a run whose fenced done could not be written comes back after its lease); the "
            f"load went on {data.load_end - data.up_at:.0f} s past its return"
        )
        if data.worker_warnings:
            t.note(
                "worker log, warnings and errors (first words: count): "
                + "; ".join(
                    f"{k}: {v}" for k, v in sorted(data.worker_warnings.items(), key=lambda kv: -kv[1])[:8]
                )
            )
        self.results["outage"] = {
            "others_p99_before": before.p99,
            "others_p99_during": during.p99,
            "ratio": ratio,
            "longest_gap_s": {"during": gap_d, "before": gap_b},
            "stopped": {
                "done": done,
                "rows": total,
                "never_started": never,
                "recovery_s": recovery,
                "waited": len(waited),
                "ran_twice": twice,
                "refused_commits": pdb.get("failed"),
            },
            "worker_warnings": data.worker_warnings,
        }

    def fairness(self) -> None:
        """Part 3: one database at ``hot_rate`` beside ``active - 1`` at ``quiet_rate``."""
        a = self.args
        names = self._active()
        hot, quiet = names[0], names[1:]
        rates = {hot: (self.fleet.dsns[hot], a.hot_rate)} | {
            n: (self.fleet.dsns[n], a.quiet_rate) for n in quiet
        }
        data = self.runner.run(
            Plan("fairness", self.fleet.dsns, rates, a.warmup, a.seconds, settle=a.settle),
            self.fleet.datnames,
        )
        bq = self.baseline(a.quiet_rate)
        bh = self.baseline(a.hot_rate)
        per = _per_db(data, quiet)
        h = latency(data, [hot], *data.window)
        q = latency(data, quiet, *data.window)
        lq = latency(bq, ["-"], *bq.window)
        lh = latency(bh, ["-"], *bh.window)
        p99s = {n: x.p99 for n, x in per.items()}
        worst = max(p99s, key=lambda n: p99s[n])
        over = [n for n, v in p99s.items() if not v <= GOAL_P99]
        t = self.report.table(
            f"3. Fairness: {hot} at {a.hot_rate:g} msg/s beside {len(quiet)} databases at "
            f"{a.quiet_rate:g} msg/s ({a.databases - a.active} idle), {a.seconds:g} s: commit -> handler "
            f"start, ms (load average {data.load[0]:.2f} -> {data.load[1]:.2f})",
            ["figure", "value", "baseline: one database alone (dsn=)", "goal"],
        )
        t.row(
            f"quiet: p99, worst database ({worst})",
            _ms(p99s[worst]),
            f"{_ms(lq.p99)} at {a.quiet_rate:g} msg/s",
            f"<= {GOAL_P99 * 1000:.0f} on every one: {_met(not over)}"
            + (f" ({len(over)} over)" if over else ""),
        )
        t.row("quiet: p99, median of the per-database p99s", _ms(_med(list(p99s.values()))), _ms(lq.p99), "")
        t.row("quiet: p99 of all their messages", _ms(q.p99), _ms(lq.p99), "")
        t.row("quiet: p50 of all their messages", _ms(q.p50), _ms(lq.p50), "")
        t.row(
            "quiet: p99 commit -> published / published -> start (share by beat's claim task)",
            legs(data, quiet, *data.window).text(),
            legs(bq, ["-"], *bq.window).text(),
            "",
        )
        t.row(
            f"hot ({hot}): p50 / p99, ms",
            f"{_ms(h.p50)} / {_ms(h.p99)}",
            f"{_ms(lh.p50)} / {_ms(lh.p99)} at {a.hot_rate:g} msg/s",
            "",
        )
        t.row(
            f"hot ({hot}): p99 commit -> published / published -> start",
            legs(data, [hot], *data.window).text(),
            legs(bh, ["-"], *bh.window).text(),
            "",
        )
        t.row(
            f"hot ({hot}): committed msg/s in the window (never started)",
            f"{h.committed / a.seconds:.0f} ({h.missing})",
            f"{lh.committed / a.seconds:.0f} ({lh.missing})",
            f"offered {a.hot_rate:g}",
        )
        t.row(
            "beat's claim tasks in the window",
            _claim_busy(data, *data.window),
            _claim_busy(bh, *bh.window) + f" at {a.hot_rate:g} msg/s",
            "",
        )
        for row in _cpu_rows(data, bq):
            t.row(*row, "")
        t.note(
            f"producer late commits (> 10 ms behind its pace): {_late(data)}; hot baseline {_late(bh)}; "
            f"CPU baseline: one database at {a.quiet_rate:g} msg/s (at {a.hot_rate:g} msg/s: "
            + ", ".join(f"{k} {_share(v, a.seconds)}" for k, v in bh.cpu.items())
            + ")"
        )
        self.results["fairness"] = {
            "quiet_p99_worst": [worst, p99s[worst]],
            "quiet_p99_median": _med(list(p99s.values())),
            "quiet_p99_all": q.p99,
            "hot": {"p50": h.p50, "p99": h.p99, "rate": h.committed / a.seconds},
            "baseline_quiet": {"p50": lq.p50, "p99": lq.p99},
            "baseline_hot": {"p50": lh.p50, "p99": lh.p99, "rate": lh.committed / a.seconds},
            "load": data.load,
        }


def _longest_gap(data: RunData, names: Sequence[str], lo: float, hi: float) -> float:
    """The longest stretch of ``[lo, hi)`` with no handler start of ``names`` (any message)."""
    times = sorted(t for n in names for ts in data.starts.get(n, {}).values() for t in ts if lo <= t < hi)
    edges = [lo, *times, hi]
    return max(b - a for a, b in itertools.pairwise(edges))


def _claim_busy(data: RunData, lo: float, hi: float) -> str:
    """How much of ``[lo, hi)`` beat's claim tasks held a pool process: share, longest task, and
    how many that started in it never returned (killed at their time limit, or still running)."""
    spans = [(max(a, lo), min(b, hi)) for a, b in data.claim_spans if a < hi and b > lo]
    held = sum(b - a for a, b in spans)
    longest = max((b - a for a, b in data.claim_spans if lo <= a < hi), default=0.0)
    started = sum(1 for _, t in data.claim_tasks if lo <= t < hi)
    ended = sum(1 for a, _ in data.claim_spans if lo <= a < hi)
    return (
        f"{held / (hi - lo):.0%} of one pool process (longest {longest:.1f} s"
        + (f"; {started - ended} of {started} never returned" if started > ended else "")
        + ")"
    )


def _share(cpu: float | None, seconds: float) -> str:
    return "-" if cpu is None else f"{cpu / seconds:.0%}"


def _cpu_rows(data: RunData, base: RunData) -> list[tuple[str, str, str]]:
    """CPU over the window as a share of one CPU, beside the baseline's."""
    seconds = data.window[1] - data.window[0]
    names = {
        "main": f"CPU, worker main process ({data.main_threads} threads; one CPU = 100%)",
        "pool": "CPU, worker pool processes",
        "server": "CPU, PostgreSQL server processes",
    }
    if "claim" in data.cpu:
        names["claim"] = "CPU, claim worker (solo: listeners and beat's claim task)"
    return [
        (label, _share(data.cpu.get(k), seconds), _share(base.cpu.get(k), base.window[1] - base.window[0]))
        for k, label in names.items()
    ]


def _late(data: RunData) -> int:
    return sum(int(d.get("late", 0)) for d in data.producer.get("databases", {}).values())


# -- options and entry points -------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    """The options (``python -m benchmarks --only databases`` runs the defaults)."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.databases",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Defaults: a full run; --short changes those marked 'short' unless given.",
    )
    p.add_argument(
        "--dsn",
        help="a PostgreSQL server's maintenance database with stock settings (default: a private cluster of "
        "the installed PostgreSQL, else the embedded one)",
    )
    p.add_argument("--redis-url", help=f"Redis broker (default {LOCAL_REDIS} if reachable, else embedded)")
    p.add_argument("--short", action="store_true", help="a smoke run of about three minutes (values below)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated among {', '.join(PARTS)} (all)")

    def opt(name: str, kind: type, text: str) -> None:
        full, short = DEFAULTS[name.replace("-", "_")]
        shown = "the library's" if full is None else f"{full:g}"
        p.add_argument(f"--{name}", type=kind, help=f"{text} (default {shown}; short {short:g})")

    opt("databases", int, "databases created on the server, all served by one Outbox")
    opt("active", int, "databases producing (the first ones; the others stay idle)")
    opt("rate", float, "msg/s per active database, load and outage parts")
    opt("seconds", float, "measured seconds of each run (the window)")
    opt("down-seconds", float, "seconds the stopped database stays unavailable (0: no outage part)")
    opt("hot-rate", float, "msg/s of the hot database, fairness part")
    opt("quiet-rate", float, "msg/s of each other active database, fairness part")
    opt("lease", float, "Outbox lease, s")
    opt("idle-sweep", float, "Outbox idle_sweep, s")
    opt("database-idle-close", float, "Outbox database_idle_close, s")
    p.add_argument("--claim-interval", type=float, help="Outbox claim_interval, s (default the library's)")
    p.add_argument(
        "--settle",
        type=float,
        help="seconds the worker runs without load before a run of many databases (idle_sweep + 5)",
    )
    p.add_argument(
        "--baseline-settle", type=float, default=2.0, help="the same before the baseline's runs (2)"
    )
    p.add_argument(
        "--warmup", type=float, default=10.0, help="seconds of load before the window, every run (10)"
    )
    p.add_argument("--concurrency", type=int, default=2, help="prefork processes of the worker (2)")
    p.add_argument(
        "--claim-worker",
        action="store_true",
        help="run the claims in a worker of their own (-Q <claim queue> -P solo -c 1, as docs/celery.md "
        "shows), the prefork worker consuming the delivery queue only; the baseline too",
    )
    p.add_argument("--json", type=Path, help="also write the figures here as JSON")
    p.add_argument("--logs", type=Path, help="copy each run's worker, beat and producer logs here")
    return p


def _resolve(a: argparse.Namespace) -> OutboxConfig:
    """Fill the defaults (full or short); the Outbox's resolved settings."""
    for name, (full, short) in DEFAULTS.items():
        if getattr(a, name) is None:
            setattr(a, name, short if a.short else full)
    a.active = min(a.active, a.databases)
    given = {
        k: getattr(a, k)
        for k in ("lease", "idle_sweep", "database_idle_close", "claim_interval")
        if getattr(a, k) is not None
    }
    a.outbox_settings = given
    config = OutboxConfig().replace(**given)
    if a.settle is None:
        a.settle = config.idle_sweep + 5.0
    return config


def _max_connections(a: argparse.Namespace, config: OutboxConfig) -> int:
    """Room for one LISTEN per database, two pooled connections per database and process (a
    claim run holds the claim lock's and the claim's; the idle sweep keeps them open), the active
    databases' pools in full, the producers and the benchmark."""
    c, n, active = int(a.concurrency), int(a.databases), int(a.active)
    return max(100, n * (1 + 2 * (c + 1)) + (c + 1) * config.pool_max_size * active + 2 * active + 50)


def run(
    a: argparse.Namespace, dsn: str | None, redis_url: str, workdir: Path, report: Report
) -> dict[str, Any]:
    """Every chosen part on a stock server (``dsn``, else private); prints, returns the figures."""
    config = _resolve(a)
    parts = [s.strip() for s in a.parts.split(",") if s.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown parts {sorted(unknown)}; choose among {', '.join(PARTS)}")
    settings = [
        f"max_connections={_max_connections(a, config)}",
        "shared_preload_libraries=pg_stat_statements",
        "pg_stat_statements.max=20000",
    ]
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(stock_server(dsn, workdir, settings=settings))
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            use_statements = _stats_ok(conn)
            row = conn.execute("SHOW max_connections").fetchone()
        report.text(f"server: {server.describe()}; max_connections {row[0] if row else '?'}")
        report.text(
            f"broker: {redact_url(redis_url)}; {os.cpu_count()} CPUs (shared: figures vary), load average "
            + " ".join(f"{x:.2f}" for x in os.getloadavg())
        )
        if server.autovacuum != "on":
            report.text(
                "WARNING: autovacuum is off on this server: not the stock settings this benchmark needs"
            )
        if not use_statements:
            report.text("pg_stat_statements is not loaded: idle cost counted from xact_commit")
        flt = stack.enter_context(fleet(server, a.databases, drop=dsn is not None))
        report.text(
            f"{a.databases} databases created and migrated in {flt.setup_seconds:.1f} s; Outbox settings: "
            f"lease {config.lease:g} s, claim_interval {config.claim_interval:g} s, idle_sweep "
            f"{config.idle_sweep:g} s, database_idle_close {config.database_idle_close:g} s, pool_max_size "
            f"{config.pool_max_size}, push on; worker: prefork x{a.concurrency}, prefetch 1, "
            "-Q claim,deliver; one beat"
        )
        runner = Runner(
            server.dsn,
            redis_url,
            workdir,
            a.concurrency,
            a.outbox_settings,
            config.lease,
            use_statements,
            getattr(a, "logs", None),
            a.claim_worker,
        )
        bench = Bench(a, flt, runner, report, config)
        bench.results["server"] = server.describe()
        if "load" in parts or "outage" in parts:
            bench.load(outage="outage" in parts)
        if "fairness" in parts:
            bench.fairness()
        report.flush()
        return bench.results


@contextlib.contextmanager
def _redis(url: str | None, workdir: Path) -> Iterator[str]:
    if url:
        yield url
    elif reachable(LOCAL_REDIS, 6379):
        yield LOCAL_REDIS
    else:
        with embedded_redis(workdir / "redis") as embedded:
            yield embedded


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, run, print."""
    a = parser().parse_args(argv)
    started = time.monotonic()
    report = Report(sys.stdout)
    report.text(
        f"outbox-celery: several databases, one Outbox ({datetime.now().strftime('%Y-%m-%d %H:%M')}"
        + (", --short" if a.short else "")
        + ")"
    )
    with (
        tempfile.TemporaryDirectory(prefix="outbox-databases-") as tmp,
        _redis(a.redis_url, Path(tmp)) as url,
    ):
        results = run(a, a.dsn, url, Path(tmp), report)
    if a.json:
        a.json.write_text(json.dumps(results, indent=2, default=str))
    report.text(
        f"\ntotal {time.monotonic() - started:.0f} s; load average now "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
