"""Staying fast under a pinned xmin horizon: the tooling that measures it.

A long transaction (a report, ``pg_dump``, an idle-in-transaction session, a replica with
``hot_standby_feedback``) holds back PostgreSQL's xmin horizon; VACUUM then removes no dead row
version anywhere, and every claim, start and done leaves more of them in the outbox table and
its partial indexes. Two measurements, both on a PostgreSQL server with **stock settings**
(autovacuum on):

* :func:`run_scenario`: the README deployment under steady load (one event per transaction),
  with or without a snapshot pinned for a while (:class:`Monitor` holds it and samples the table
  every second); :func:`windows` cuts commit -> handler start into fixed windows, with the
  unfinished rows and dead versions sampled meanwhile, and :func:`summarize` judges the goals.
* :func:`measure_claim_vs_dead`: no Celery, one claim process (one :class:`Store` and one
  connection reused across claims, as the claim loop uses them) timing a claim of 200 rows with
  0, 100k, 500k... dead versions in front of it, made by a pinned snapshot.

:func:`stock_server` starts the server: a private cluster of the installed PostgreSQL
(``pg_config --bindir``; initdb run as the ``postgres`` OS user when this runs as root), or the
embedded PostgreSQL 18 when that cannot be done. Never the shared server of a development
machine, which may run with autovacuum off.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pwd
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from outbox_celery import TableName, migrate, ops
from outbox_celery.claim import executor
from outbox_celery.claim.executor import Claimed, ScanMarks
from outbox_celery.db.store import Store
from outbox_celery.testing import embedded_postgres, free_port

from .measure import percentile
from .pipeline import Pipeline, drop_table
from .plain import fill_pending
from .variants import parse as parse_variants

__all__ = [
    "ClaimLevel",
    "Monitor",
    "Sample",
    "StockServer",
    "claim_once",
    "measure_claim_vs_dead",
    "run_scenario",
    "stock_server",
    "summarize",
    "windows",
]

PIN_APP = "bench-horizon-pin"
READER_APP = "bench-horizon-reader"


# -- the server --------------------------------------------------------------------------------


@dataclass(frozen=True)
class StockServer:
    """A server with stock settings: its maintenance DSN and how it came to be."""

    dsn: str
    origin: str
    version: str = "?"
    autovacuum: str = "?"

    def describe(self) -> str:
        """One line for the report header (no password: the private clusters use trust)."""
        return f"{self.origin}, PostgreSQL {self.version}, autovacuum {self.autovacuum}"


def _server_facts(dsn: str) -> tuple[str, str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        version = conn.execute("SHOW server_version").fetchone()
        av = conn.execute("SHOW autovacuum").fetchone()
    return (str(version[0]) if version else "?", str(av[0]) if av else "?")


@contextlib.contextmanager
def _private_cluster(settings: Sequence[str] = ()) -> Iterator[tuple[str, str]]:
    """initdb + pg_ctl of the installed PostgreSQL on a free port; yields (DSN, description).

    ``settings``: ``name=value`` server settings given on its command line (``-c``).
    """
    out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=True, timeout=30)
    bindir = Path(out.stdout.strip())
    user = None
    tmp = Path(tempfile.mkdtemp(prefix="outbox-horizon-pg-"))
    try:
        if os.geteuid() == 0:
            # initdb and postgres refuse to run as root: the cluster belongs to the postgres user.
            pw = pwd.getpwnam("postgres")
            os.chown(tmp, pw.pw_uid, pw.pw_gid)
            user = "postgres"
        data = tmp / "data"

        def run(*args: str) -> None:
            subprocess.run(list(args), check=True, capture_output=True, user=user, cwd=tmp, timeout=180)

        run(
            str(bindir / "initdb"),
            "-D",
            str(data),
            "-A",
            "trust",
            "-U",
            "postgres",
            "-E",
            "UTF8",
            "--no-sync",
        )
        port = free_port()
        options = f"-p {port} -c listen_addresses=127.0.0.1 -k {tmp}" + "".join(f" -c {x}" for x in settings)
        pg_ctl = str(bindir / "pg_ctl")
        run(pg_ctl, "-D", str(data), "-l", str(tmp / "server.log"), "-w", "-o", options, "start")
        try:
            yield (
                f"postgresql://postgres@127.0.0.1:{port}/postgres",
                f"private cluster (initdb of {bindir}, stock settings"
                + (f" but {', '.join(settings)}" if settings else "")
                + f") on 127.0.0.1:{port}",
            )
        finally:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                run(pg_ctl, "-D", str(data), "-m", "fast", "-w", "stop")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def stock_server(dsn: str | None, workdir: Path, *, settings: Sequence[str] = ()) -> Iterator[StockServer]:
    """The server of the horizon sections: ``dsn``, else a private cluster, else embedded.

    The private cluster (or the embedded server) is stopped on exit. A ``dsn`` server whose
    autovacuum is off is used as asked, and the report says so. ``settings`` (``name=value``)
    are given to a private cluster only (the databases benchmark raises ``max_connections``
    and loads ``pg_stat_statements``); the caller reads back what it got.
    """
    if dsn:
        version, av = _server_facts(dsn)
        yield StockServer(dsn, "--dsn", version, av)
        return
    reason = ""
    with contextlib.ExitStack() as stack:
        try:
            server_dsn, origin = stack.enter_context(_private_cluster(settings))
        except (OSError, KeyError, subprocess.SubprocessError) as exc:
            detail = (
                exc.stderr.decode(errors="replace").strip()
                if isinstance(exc, subprocess.CalledProcessError) and exc.stderr
                else exc
            )
            reason = f"{type(exc).__name__}: {str(detail).splitlines()[-1] if str(detail) else ''}"
            server_dsn = stack.enter_context(embedded_postgres(workdir / "horizon-pg"))
            origin = f"embedded PostgreSQL (no private cluster: {reason})"
        version, av = _server_facts(server_dsn)
        yield StockServer(server_dsn, origin, version, av)


# -- the pinned snapshot and the sampler ---------------------------------------------------------


class Pin:
    """A REPEATABLE READ transaction that took its snapshot with one query and now sits idle."""

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn, application_name=PIN_APP)
        self.conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        row = self.conn.execute("SELECT pg_current_snapshot()::text").fetchone()
        self.snapshot = str(row[0]) if row else "?"
        self.pid = self.conn.info.backend_pid
        self.started = time.time()

    def holds(self, admin: psycopg.Connection[Any]) -> tuple[bool, int]:
        """Whether the session still holds a ``backend_xmin``, and its age in transactions."""
        row = admin.execute(
            "SELECT backend_xmin IS NOT NULL, coalesce(age(backend_xmin), 0)"
            " FROM pg_stat_activity WHERE pid = %s",
            [self.pid],
        ).fetchone()
        return (bool(row[0]), int(row[1])) if row else (False, 0)

    def release(self) -> float:
        """Roll back and close; returns how long the snapshot was held."""
        with contextlib.suppress(psycopg.Error):
            self.conn.rollback()
        self.conn.close()
        return time.time() - self.started


def backend_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a local process (a PostgreSQL backend), from ``/proc``."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Readers:
    """``n`` REPEATABLE READ readers, each scanning the table every ``every`` seconds in its
    one snapshot (the "active readers" of the public job-queue benchmark harness, instead of one
    idle snapshot), and what they cost: their backends' CPU seconds, read from ``/proc`` when
    the server runs on this machine."""

    def __init__(self, dsn: str, ident: sql.Composable, n: int, *, every: float = 0.1) -> None:
        self.dsn, self.ident, self.every = dsn, ident, every
        self.stop = threading.Event()
        self.scans: list[float] = []
        self.pids: list[int] = []
        self.cpu0: dict[int, float] = {}
        self.cpu1: dict[int, float | None] = {}
        self.started = time.time()
        self.threads = [threading.Thread(target=self._read, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _read(self) -> None:
        with psycopg.connect(self.dsn, application_name=READER_APP) as conn:
            conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            pid = conn.info.backend_pid
            self.pids.append(pid)
            self.cpu0[pid] = backend_cpu_seconds(pid) or 0.0
            query = sql.SQL("SELECT count(*) FROM {t}").format(t=self.ident)
            while not self.stop.wait(self.every):
                t = time.perf_counter()
                conn.execute(query)
                self.scans.append(time.perf_counter() - t)
            self.cpu1[pid] = backend_cpu_seconds(pid)
            conn.rollback()

    def finish(self) -> dict[str, Any]:
        """Stop the readers; their scans and CPU (seconds, and the share of the machine's CPUs)."""
        self.stop.set()
        for t in self.threads:
            t.join(60)
        held = time.time() - self.started
        ends = [self.cpu1.get(p) for p in self.pids]
        cpu = [end - self.cpu0[p] for p, end in zip(self.pids, ends, strict=True) if end is not None]
        out: dict[str, Any] = {
            "readers": len(self.threads),
            "scans": len(self.scans),
            "held_s": round(held, 1),
        }
        if self.scans:
            out["scan_ms_median"] = round(statistics.median(self.scans) * 1000, 1)
            out["scan_ms_max"] = round(max(self.scans) * 1000, 1)
        if cpu and len(cpu) == len(self.pids):
            cores = os.cpu_count() or 1
            out["readers_cpu_s"] = round(sum(cpu), 1)
            out["readers_cpu_share"] = f"{sum(cpu) / (held * cores):.0%} of {cores} CPUs"
        return out


@dataclass
class Sample:
    """One look at the table (seconds since the measured load started)."""

    t: float
    unfinished: int
    dead: int
    autovacuums: int
    pinned: bool
    xmin_age: int
    count_ms: float


def _unfinished_indexes(conn: psycopg.Connection[Any], ident: sql.Composable) -> int:
    """The unordered unfinished rows counted from the pending and lease indexes, whole.

    The sampler of the first measurements (``index_sampler``): under a pin each count walks
    every dead entry of both indexes, and once autoanalyze has seen the churned table the
    planner counts the pending rows with a parallel sequential scan of the whole heap (three
    processes): at 1M dead versions 0.5 s of every second, on the machine it measures.
    """
    row = conn.execute(
        sql.SQL(
            "SELECT (SELECT count(*) FROM {t} WHERE status = 'pending' AND ordering_key IS NULL)"
            " + (SELECT count(*) FROM {t} WHERE status = 'processing')"
        ).format(t=ident)
    ).fetchone()
    return int(row[0]) if row else 0


class UnfinishedCounter:
    """Counts the unfinished rows from the oldest one of the previous count on, by primary key.

    Every unfinished row's id is at least the lowest unfinished id the previous count saw (ids
    only grow, and a finished row stays finished in this benchmark), so one range of the primary
    key from there holds them all: its cost is the versions of the rows written since the oldest
    unfinished one, bounded by how far behind delivery is, never by the length of a pin. Custom
    plans only, no parallel workers, no sequential scan: the sampler must not be the load.
    """

    def __init__(self, conn: psycopg.Connection[Any], ident: sql.Composable) -> None:
        self.conn = conn
        self.low = 0
        conn.execute("SET max_parallel_workers_per_gather = 0")
        conn.execute("SET enable_seqscan = off")
        self.query = sql.SQL(
            "SELECT count(*), min(id) FROM {t} WHERE id >= %s AND status IN ('pending', 'processing')"
        ).format(t=ident)
        self.top = sql.SQL("SELECT coalesce(max(id), 0) + 1 FROM {t}").format(t=ident)

    def __call__(self) -> int:
        """The unfinished rows now."""
        row = self.conn.execute(self.query, [self.low], prepare=False).fetchone()
        n, low = (int(row[0]), row[1]) if row else (0, None)
        if low is not None:
            self.low = int(low)
        else:  # nothing unfinished: the next count starts past every row there is now
            top = self.conn.execute(self.top).fetchone()
            self.low = max(self.low, int(top[0]) if top else 0)
        return n


def churn_dead_versions(dsn: str, ident: sql.Composable, dead: int, *, chunk: int = 10_000) -> float:
    """Make about ``dead`` dead versions in the live table as deliveries make them, fast.

    Rows of an event type nobody handles (``bench.churn``, negative ids) inserted due, then claimed, started
    and done, ``chunk`` at a time, with the column changes of the claim, the fenced start and
    the done (3 dead versions per row, in the pending, lease and primary-key indexes): what
    ``dead / 3`` messages leave under a pin, in seconds instead of minutes. Returns the seconds.
    """
    t0 = time.perf_counter()
    made = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        while made < dead:
            n = min(chunk, max(1, (dead - made + 2) // 3))
            with conn.transaction():
                ids = [
                    r[0]
                    for r in conn.execute(
                        sql.SQL(_CHURN_INSERT).format(t=ident),
                        [made // 3, made // 3, n],
                    )
                ]
            for step in (_CHURN_CLAIM, _START_MANY, _DONE_MANY):
                conn.execute(sql.SQL(step).format(t=ident), [ids])
            made += 3 * n
            time.sleep(0.2)  # let the deliveries breathe between chunks
    return time.perf_counter() - t0


def _dead_tuples(conn: psycopg.Connection[Any], table: str) -> tuple[int, int]:
    """``(n_dead_tup, autovacuum_count)`` of ``table`` from the cumulative statistics."""
    row = conn.execute(
        "SELECT n_dead_tup, autovacuum_count FROM pg_stat_user_tables WHERE relid = %s::regclass",
        [TableName.parse(table).qualified],
    ).fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)


def _old_done_rows(conn: psycopg.Connection[Any], ident: sql.Composable, n: int) -> None:
    """``n`` done rows finished eight days ago: a week of history for the retention purge."""
    conn.execute(
        sql.SQL(
            "INSERT INTO {t} (event_type, aggregate_type, aggregate_id, payload, status, created_at,"
            " available_at, done_at, lease_version, started_version, attempts)"
            " SELECT 'bench.history', 'bench', g::text, '{{}}', 'done', now() - interval '8 days',"
            " now() - interval '8 days', now() - interval '8 days', 1, 1, 1"
            " FROM generate_series(1, %s) AS g"
        ).format(t=ident),
        [n],
    )


class Monitor:
    """Samples the outbox table every ``every`` seconds and pins the horizon on schedule.

    :meth:`start` (given the table) marks t = 0; the pin is taken at ``pin_at`` seconds and
    released ``pin_for`` seconds later (no pin when ``pin_at`` is ``None``). Each sample counts
    the unfinished rows (timed: that count walks the same partial indexes as the claim), reads
    the table's dead tuples and autovacuum count, and checks that the pin still holds its xmin.
    """

    def __init__(
        self,
        dsn: str,
        *,
        pin_at: float | None,
        pin_for: float,
        every: float = 1.0,
        purge_rows: int = 0,
        churn: int = 0,
        index_sampler: bool = False,
        readers: int = 0,
    ) -> None:
        self.dsn = dsn
        #: REPEATABLE READ readers scanning the table during the pin (:class:`Readers`).
        self.readers = readers
        self._readers: Readers | None = None
        #: Dead versions churned into the table when the pin is taken (:func:`churn_dead_versions`).
        self.churn = churn
        self._churn: threading.Thread | None = None
        #: Count the unfinished rows as the first measurements did (:func:`_unfinished_indexes`).
        self.index_sampler = index_sampler
        #: Instead of a pin: ``purge_rows`` done rows a week old are written at t = 0 and the
        #: retention purge (``admin.purge_done``, its default batches) deletes them at ``pin_at``.
        self.purge_rows = purge_rows
        self._purge: threading.Thread | None = None
        self.pin_at = pin_at
        self.pin_for = pin_for
        self.every = every
        self.t0 = 0.0
        self.table = ""
        self.samples: list[Sample] = []
        self.pin_log: dict[str, Any] = {}
        self.error: str | None = None
        self._pin: Pin | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, table: str) -> None:
        """t = 0: the measured load starts now."""
        self.table = table
        self.t0 = time.time()
        self._thread = threading.Thread(target=self._run, name="horizon-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling; release the pin if it is still held; wait for a purge to end."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        if self._purge is not None:
            self._purge.join(300)
        if self._churn is not None:
            self._churn.join(300)
        self._unpin()

    def _run_purge(self) -> None:
        t = time.perf_counter()
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                deleted = ops.purge_done(conn, self.table, older_than=7 * 86400.0, batch_size=5000)
            self.pin_log.update(purge_deleted=deleted, purge_s=round(time.perf_counter() - t, 2))
        except Exception as exc:  # reported, the run goes on
            self.error = f"purge: {type(exc).__name__}: {exc}"

    def _run_churn(self) -> None:
        try:
            ident = TableName.parse(self.table).identifier()
            seconds = churn_dead_versions(self.dsn, ident, self.churn)
            self.pin_log.update(churned=self.churn, churn_s=round(seconds, 1))
        except Exception as exc:  # reported, the run goes on
            self.error = f"churn: {type(exc).__name__}: {exc}"

    def _unpin(self) -> None:
        if self._readers is not None:
            self.pin_log.update(self._readers.finish())
            self._readers = None
        if self._pin is not None:
            self.pin_log["held_s"] = round(self._pin.release(), 2)
            self.pin_log["released_t"] = round(time.time() - self.t0, 2)
            self._pin = None

    def _run(self) -> None:
        ident = TableName.parse(self.table).identifier()
        try:
            with (
                psycopg.connect(self.dsn, autocommit=True) as conn,
                psycopg.connect(self.dsn, autocommit=True) as counting,
            ):
                count = (
                    functools.partial(_unfinished_indexes, counting, ident)
                    if self.index_sampler
                    else UnfinishedCounter(counting, ident)
                )
                if self.purge_rows:
                    _old_done_rows(conn, ident, self.purge_rows)
                k = 0
                while not self._stop.wait(max(0.0, self.t0 + k * self.every - time.time())):
                    k += 1
                    now = time.time() - self.t0
                    if (
                        self.purge_rows
                        and self.pin_at is not None
                        and not self.pin_log
                        and now >= self.pin_at
                    ):
                        self.pin_log = {"purge_started_t": round(now, 2), "purge_rows": self.purge_rows}
                        self._purge = threading.Thread(
                            target=self._run_purge, name="horizon-purge", daemon=True
                        )
                        self._purge.start()
                    elif self.pin_at is not None and not self.pin_log and now >= self.pin_at:
                        self._pin = Pin(self.dsn)
                        held, _ = self._pin.holds(conn)
                        self.pin_log = {"taken_t": round(now, 2), "pid": self._pin.pid, "xmin_held": held}
                        self.pin_log["snapshot"] = self._pin.snapshot
                        if not held:
                            raise RuntimeError("the pinned transaction holds no backend_xmin")
                        if self.readers:
                            self._readers = Readers(self.dsn, ident, self.readers)
                        if self.churn:
                            self._churn = threading.Thread(
                                target=self._run_churn, name="horizon-churn", daemon=True
                            )
                            self._churn.start()
                    if self._pin is not None and now >= self.pin_at + self.pin_for:  # type: ignore[operator]
                        self._unpin()
                    t = time.perf_counter()
                    unfinished = count()
                    count_ms = (time.perf_counter() - t) * 1000
                    dead, vacuums = _dead_tuples(conn, self.table)
                    held, age = self._pin.holds(conn) if self._pin is not None else (False, 0)
                    if self._pin is not None and not held:
                        self.pin_log.setdefault("lost_xmin_t", round(now, 2))
                    self.samples.append(Sample(now, unfinished, dead, vacuums, held, age, count_ms))
        except psycopg.errors.UndefinedTable:
            pass  # the run is over: its table was dropped before the sampler was stopped
        except Exception as exc:  # the run goes on; the report says what broke
            self.error = f"{type(exc).__name__}: {exc}"


# -- the end-to-end scenario -----------------------------------------------------------------------


@dataclass
class Scenario:
    """One run of the README deployment, with or without a pin."""

    label: str
    rate: float
    duration: float
    pin_at: float | None
    pin_for: float
    window: float
    windows: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    pin: dict[str, Any] = field(default_factory=dict)
    monitor_error: str | None = None
    producer_late: int = 0
    achieved_rate: float = 0.0
    #: 1-minute load average when the run started and ended: other work on the machine shows here.
    load: tuple[float, float] = (0.0, 0.0)

    def as_dict(self) -> dict[str, Any]:
        """JSON form (samples included: one a second)."""
        d = asdict(self)
        d["samples"] = [asdict(s) for s in self.samples]
        return d


def run_scenario(
    pipeline: Pipeline,
    broker_url: str,
    *,
    label: str,
    rate: float,
    warmup: float,
    pin: float,
    tail: float,
    pinned: bool,
    window: float = 10.0,
    claim_interval: float,
    batch_size: int,
    warmup_messages: int = 1000,
    purge_rows: int = 0,
    churn: int = 0,
    variant: str = "",
    readers: int = 0,
) -> Scenario:
    """``warmup + pin + tail`` seconds of one event per transaction at ``rate``; pinned or not.

    The unpinned run (the baseline) marks the same span as "the pin" so both read alike.
    """
    duration = warmup + pin + tail
    event = pinned or purge_rows > 0
    monitor = Monitor(
        pipeline.dsn,
        pin_at=warmup if event else None,
        pin_for=pin,
        purge_rows=purge_rows,
        churn=churn if pinned else 0,
        index_sampler="index_sampler" in parse_variants(variant),
        readers=readers if pinned else 0,
    )
    scenario = Scenario(label, rate, duration, warmup, pin, window)
    load_before = os.getloadavg()[0]
    try:
        r = pipeline.outbox(
            broker_url,
            0,
            rate=rate,
            duration=duration,
            single_worker=True,
            claim_interval=claim_interval,
            batch_size=batch_size,
            warmup=warmup_messages,
            on_measured=monitor.start,
            tag="horizon",
            variant=variant,
        )
    finally:
        monitor.stop()
    scenario.load = (load_before, os.getloadavg()[0])
    legs = r.extra["latency_s"]
    scenario.samples = monitor.samples
    scenario.pin = monitor.pin_log
    scenario.monitor_error = monitor.error
    scenario.producer_late = int(r.extra.get("producer_late") or 0)
    scenario.achieved_rate = r.rate
    scenario.windows = windows(
        legs["commit"], legs["total"], monitor.t0, monitor.samples, width=window, pin=(warmup, warmup + pin)
    )
    scenario.summary = summarize(scenario.windows, legs["commit"], legs["total"], monitor.t0, scenario)
    return scenario


def windows(
    commits: Sequence[float],
    totals: Sequence[float],
    t0: float,
    samples: Sequence[Sample],
    *,
    width: float,
    pin: tuple[float, float],
) -> list[dict[str, Any]]:
    """Per ``width``-second window (by commit time since ``t0``): latencies, starts, table state.

    ``pinned``: the window overlaps ``pin`` (start, end), seconds since ``t0``.
    """
    if not commits:
        return []
    end = max(max(c - t0 for c in commits), max((s.t for s in samples), default=0.0))
    n = int(end // width) + 1
    lat: list[list[float]] = [[] for _ in range(n)]
    started = [0] * n
    for c, total in zip(commits, totals, strict=True):
        k = int((c - t0) // width)
        if 0 <= k < n:
            lat[k].append(total)
        s = int((c + total - t0) // width)
        if 0 <= s < n:
            started[s] += 1
    out = []
    for k in range(n):
        lo, hi = k * width, (k + 1) * width
        inside = [s for s in samples if lo <= s.t < hi]
        values = sorted(lat[k])
        out.append(
            {
                "t": lo,
                "pinned": lo < pin[1] and hi > pin[0],
                "pin_held": any(s.pinned for s in inside),
                "committed": len(values),
                "started": started[k],
                "p50": percentile(values, 0.5) if values else None,
                "p99": percentile(values, 0.99) if values else None,
                "max": values[-1] if values else None,
                "unfinished_max": max((s.unfinished for s in inside), default=None),
                "dead": inside[-1].dead if inside else None,
                "autovacuums": inside[-1].autovacuums if inside else None,
                "count_ms_max": max((s.count_ms for s in inside), default=None),
            }
        )
    return out


def summarize(
    wins: Sequence[dict[str, Any]],
    commits: Sequence[float],
    totals: Sequence[float],
    t0: float,
    scenario: Scenario,
) -> dict[str, Any]:
    """p99 before the pin, worst p99 over the pinned windows, unfinished rows; goals judged.

    Before the pin: messages committed from the end of the first window (which settles in) to
    the pin. Goals: p99 in every pinned window <= 250 ms and <= 3x the p99 before the pin;
    unfinished rows never above one second of production (``rate``).
    """
    pin_at = scenario.pin_at or 0.0
    settle = scenario.window if pin_at > scenario.window else 0.0
    before = sorted(total for c, total in zip(commits, totals, strict=True) if settle <= c - t0 < pin_at)
    p99_before = percentile(before, 0.99) if before else float("nan")
    pinned = [w for w in wins if w["pinned"] and w["p99"] is not None]
    worst = max((w["p99"] for w in pinned), default=float("nan"))
    unfinished = max((w["unfinished_max"] or 0 for w in wins), default=0)
    dead = max((w["dead"] or 0 for w in wins), default=0)
    p99_ok = all(w["p99"] <= 0.250 and w["p99"] <= 3 * p99_before for w in pinned)
    return {
        "p99_before": p99_before,
        "p99_worst_pinned": worst,
        "ratio": worst / p99_before if p99_before else float("nan"),
        "unfinished_max": unfinished,
        "dead_max": dead,
        "p99_goal_met": bool(pinned) and p99_ok,
        "unfinished_goal_met": unfinished <= scenario.rate,
        "recovered_s": _recovered(wins, scenario, p99_before),
    }


def _recovered(wins: Sequence[dict[str, Any]], scenario: Scenario, p99_before: float) -> float | None:
    """Seconds after the pin's end until a window's p99 is back within 3x the p99 before it."""
    end = (scenario.pin_at or 0.0) + scenario.pin_for
    for w in wins:
        if w["t"] + scenario.window > end and w["p99"] is not None and w["p99"] <= 3 * p99_before:
            return max(0.0, float(w["t"]) - end)
    return None


# -- claim cost vs dead versions -----------------------------------------------------------------


# The fenced start and done of the real path (queries.sql: start, finish_done), for many rows at
# once: the same columns change, so the same row versions and index entries are made.
# Negative ids: the churned rows stay out of the sampler's range of the primary key.
_CHURN_INSERT = (
    "INSERT INTO {t} (id, event_type, aggregate_type, aggregate_id, payload, available_at)"
    " OVERRIDING SYSTEM VALUE"
    " SELECT -g, 'bench.churn', 'bench', g::text, '{{}}', now() - interval '1 second'"
    " FROM generate_series(%s::bigint + 1, %s::bigint + %s) AS g RETURNING id"
)
_CHURN_CLAIM = (
    "UPDATE {t} SET status = 'processing', lease_owner = 'bench-churn', lease_version = lease_version + 1,"
    " lease_until = now() + make_interval(secs => 60) WHERE id = ANY(%s) AND status = 'pending'"
)
_START_MANY = (
    "UPDATE {t} SET attempts = attempts + 1, started_version = lease_version,"
    " lease_until = greatest(lease_until, now() + make_interval(secs => 60))"
    " WHERE id = ANY(%s) AND status = 'processing'"
)
_DONE_MANY = (
    "UPDATE {t} SET status = 'done', done_at = now(), lease_until = NULL"
    " WHERE id = ANY(%s) AND status = 'processing' AND ordering_key IS NULL"
)


@dataclass
class Claimer:
    """One claim process: one :class:`Store` and one connection, reused for every claim."""

    conn: psycopg.Connection[Any]
    store: Store
    owner: str = "bench-horizon-claim"
    lease: float = 60.0
    max_attempts: int = 12
    #: The claim loop's scan marks (invariant 18); None: every scan from the index start.
    marks: ScanMarks | None = None


def claim_once(claimer: Claimer, limit: int) -> list[Claimed]:
    """One claim, exactly as the claim loop makes it: the only place the probe claims.

    Keywords only, on the one store object the probe keeps (a per-process low-water mark in it,
    or in a dispatcher wrapping it, carries over from claim to claim as in production).
    """
    result = executor.claim(
        claimer.store,
        claimer.conn,
        limit=limit,
        lease=claimer.lease,
        owner=claimer.owner,
        max_attempts=claimer.max_attempts,
        marks=claimer.marks,
    )
    return result.claimed


def _finish(conn: psycopg.Connection[Any], ident: sql.Composable, ids: list[int]) -> None:
    """The fenced start and the done of ``ids``, one statement each (untimed)."""
    if ids:
        conn.execute(sql.SQL(_START_MANY).format(t=ident), [ids])
        conn.execute(sql.SQL(_DONE_MANY).format(t=ident), [ids])


@dataclass
class ClaimLevel:
    """Claims timed with ``dead`` dead versions (made under the pin) in front of them."""

    label: str
    dead: int
    n_dead_tup: int
    claim_ms: list[float]
    rows: list[int]
    churn_seconds: float = 0.0
    #: One ``admin.stats`` (what ``outbox-celery stats`` and each Prometheus scrape run), ms.
    stats_ms: float = 0.0

    @property
    def median_ms(self) -> float:
        """Median claim time."""
        return statistics.median(self.claim_ms)

    def as_dict(self) -> dict[str, Any]:
        """JSON form."""
        return asdict(self) | {"median_ms": self.median_ms}


def measure_claim_vs_dead(
    dsn: str,
    *,
    levels: Sequence[int],
    claims: int = 7,
    limit: int = 200,
    churn_batch: int = 10_000,
    table: str = "bench_horizon_claim",
    marks: bool = True,
) -> list[ClaimLevel]:
    """Time ``claims`` claims of ``limit`` rows at 0 dead versions, then at each of ``levels``.

    Churn under a pinned snapshot makes the dead versions the real path makes: rows inserted,
    claimed (:func:`claim_once`, ``churn_batch`` at a time), started and done (3 dead versions
    per row). Before each level's timed claims, ``claims * limit`` fresh due rows are inserted
    behind the churn; each claimed batch is started and done (untimed) before the next claim.
    After the last level the pin is released and the table vacuumed: a last row, for recovery.

    ``marks``: the claimer keeps scan marks as the claim loop does (invariant 18), with the
    default look-back; the churn squeezes minutes of traffic into seconds, so the timed claims
    wait one look-back first (what a claim steps over within it, the rows of that many seconds
    of real traffic, is not what this measures). ``False``: every scan from the index start.
    """
    ident = TableName.parse(table).identifier()
    drop_table(dsn, table)
    with psycopg.connect(dsn, autocommit=True) as setup:
        migrate(setup, table)
    out: list[ClaimLevel] = []
    pin: Pin | None = None
    made = 0
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            claimer = Claimer(conn, Store(table), marks=ScanMarks() if marks else None)

            def timed(label: str, churn_seconds: float = 0.0) -> None:
                if claimer.marks is not None:
                    time.sleep(claimer.marks.lookback)
                fill_pending(conn, table, claims * limit)
                conn.execute(sql.SQL("ANALYZE {}").format(ident))
                times, rows = [], []
                for _ in range(claims):
                    t = time.perf_counter()
                    got = claim_once(claimer, limit)
                    times.append((time.perf_counter() - t) * 1000)
                    rows.append(len(got))
                    _finish(conn, ident, [c.id for c in got])
                nonlocal made
                made += 3 * sum(rows) if pin is not None else 0
                conn.execute("SELECT pg_stat_force_next_flush()")
                t = time.perf_counter()
                ops.stats(conn, table)
                stats_ms = (time.perf_counter() - t) * 1000
                dead = _dead_tuples(conn, table)[0]
                out.append(ClaimLevel(label, made, dead, times, rows, churn_seconds, stats_ms))

            conn.execute(sql.SQL("VACUUM (ANALYZE) {}").format(ident))
            timed("0 dead versions (baseline)")
            pin = Pin(dsn)
            for level in sorted(levels):
                t0 = time.monotonic()
                while made < level:
                    n = min(churn_batch, max(1, (level - made + 2) // 3))
                    fill_pending(conn, table, n)
                    got: list[Claimed] = []
                    while len(got) < n:
                        more = claim_once(claimer, n - len(got))
                        if not more:
                            break
                        got += more
                    _finish(conn, ident, [c.id for c in got])
                    made += 3 * len(got)
                timed(f"{level:,} dead versions", time.monotonic() - t0)
            pin.release()
            pin = None
            conn.execute(sql.SQL("VACUUM {}").format(ident))
            made = 0
            timed("pin released, VACUUM")
    finally:
        if pin is not None:
            pin.release()
        drop_table(dsn, table)
    return out
