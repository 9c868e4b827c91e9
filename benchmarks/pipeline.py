"""End-to-end runs with real worker processes: bare Celery and the outbox, side by side.

Both pipelines run their publisher (bare) or producer (outbox) at the same time as their
workers, with the same broker, pool, concurrency and prefetch, and count a message as finished
in ``task_postrun`` (for the outbox: after the fenced finalize committed). Throughput is
messages / (last completion - first publish or first enqueue).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import psycopg
from kombu import Connection
from psycopg import sql

from outbox_celery import TableName, migrate
from outbox_celery.db.statements import (
    FLOW_KEY_SUFFIX,
    FLOW_SUFFIX,
    GROUP_SUFFIX,
    INSTANCE_SUFFIX,
    SUBSCRIPTION_SUFFIX,
)

from .counter import CompletionCounter
from .measure import (
    backend_pids,
    cpu_seconds,
    db_per_message,
    last_json_line,
    listening_pid,
    pg_counters,
    rss_bytes,
)
from .procs import Proc, Processes, celery_command, wait_for

__all__ = ["Pipeline", "PipelineResult", "drop_table"]

WORKER_FLAGS = (
    "--without-heartbeat",
    "--without-gossip",
    "--without-mingle",
    "-l",
    os.environ.get("BENCH_WORKER_LOGLEVEL", "WARNING"),
)


@dataclass
class PipelineResult:
    """What one end-to-end run measured."""

    kind: str
    broker: str
    n: int
    seconds: float
    send_seconds: float
    completed: int
    cpu_ms_per_msg: dict[str, float] = field(default_factory=dict)
    db_per_msg: dict[str, float] = field(default_factory=dict)
    rss: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        """Messages per second, end to end."""
        return self.n / self.seconds if self.seconds > 0 else 0.0


def drop_table(dsn: str, table: str) -> None:
    """Drop a benchmark table (its identity table and its migration ledger rows too)."""
    t = TableName.parse(table)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(t.identifier()))
        # Its side tables (identity, migration 0006; flow control, 0007 and 0008; subscriptions,
        # 0011; groups, 0012), or the next migrate of the name fails.
        for suffix in (INSTANCE_SUFFIX, FLOW_SUFFIX, FLOW_KEY_SUFFIX, SUBSCRIPTION_SUFFIX, GROUP_SUFFIX):
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(t.identifier(suffix)))
        with contextlib.suppress(psycopg.Error):
            conn.execute("DELETE FROM outbox_celery_migrations WHERE table_name = %s", [t.name])


def _broker_name(url: str) -> str:
    return "rabbitmq" if url.startswith(("amqp", "pyamqp")) else "redis"


def _broker_port(url: str) -> int:
    parts = urlparse(url)
    return parts.port or (5672 if _broker_name(url) == "rabbitmq" else 6379)


def cleanup_queues(url: str, queues: list[str]) -> None:
    """Delete the run's queues (RabbitMQ) or their kombu bindings (Redis)."""
    with contextlib.suppress(Exception), Connection(url, connect_timeout=3) as conn:
        channel: Any = conn.default_channel
        for q in queues:
            with contextlib.suppress(Exception):
                channel.queue_delete(q)
            if _broker_name(url) == "redis":
                client = channel.client
                client.delete(f"_kombu.binding.{q}", f"_kombu.binding_permanent.{q}", q)


@dataclass
class Pipeline:
    """Runs bare and outbox pipelines in ``workdir`` against ``dsn`` and a broker."""

    dsn: str
    workdir: Path
    concurrency: int = 2
    pool: str = "prefork"
    timeout: float = 180.0

    def _worker(
        self,
        procs: Processes,
        app: str,
        name: str,
        queue: str,
        env: dict[str, str],
        *,
        pool: str,
        concurrency: int,
    ) -> Proc:
        args = ["worker", "-Q", queue, "-P", pool, "-c", str(concurrency), "-n", f"{name}@%h", *WORKER_FLAGS]
        if "BENCH_PREFETCH" in env:
            args += ["--prefetch-multiplier", env["BENCH_PREFETCH"]]
        return procs.start(name, celery_command(app, *args), env)

    def _wait(
        self, counter: CompletionCounter, n: int, watch: list[Proc], on_tick: Any = None
    ) -> tuple[int, float]:
        # Generous: a stalled pipeline still fails, a long (soak) run does not.
        deadline = time.monotonic() + self.timeout + n / 100
        while True:
            done, last = counter.read()
            if done >= n:
                return done, last
            for p in watch:
                if not p.alive() and p.popen.returncode not in (0, None):
                    raise RuntimeError(f"{p.name} exited with {p.popen.returncode}:\n{p.tail()}")
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {p.name}:\n{p.tail(8)}" for p in watch)
                raise TimeoutError(f"only {done} of {n} messages finished in time\n{tails}")
            if on_tick is not None:
                on_tick(done)
            time.sleep(0.02)

    def _load(
        self,
        procs: Processes,
        role: str,
        env: dict[str, str],
        counter: CompletionCounter,
        n: int,
        watch: list[Proc],
        on_tick: Any = None,
    ) -> tuple[dict[str, Any], int, float]:
        """Run one load generator for ``n`` messages and wait until all of them finished.

        Returns its summary, the completion count and the time of the last completion.
        """
        base, _ = counter.read()
        gen = procs.start(
            f"{role}-{uuid.uuid4().hex[:4]}",
            [sys.executable, "-m", "benchmarks.roles", role],
            {**env, "BENCH_N": str(n)},
        )
        done, last = self._wait(counter, base + n, [*watch, gen], on_tick)
        gen.popen.wait(30)
        return last_json_line(gen.log), done - base, last

    def bare(
        self, broker_url: str, n: int, *, prefetch: int = 1, warmup: int = 1000, tag: str = ""
    ) -> PipelineResult:
        """Bare Celery: a publisher process and a worker, no-op tasks (after ``warmup`` of them)."""
        run = f"{tag or 'bare'}-{uuid.uuid4().hex[:6]}"
        queue = f"bench.bare.{run}"
        counter = CompletionCounter.create(self.workdir / f"{run}.counter")
        env = {"BENCH_BROKER_URL": broker_url, "BENCH_QUEUE": queue, "BENCH_PREFETCH": str(prefetch)}
        ready = self.workdir / f"{run}.ready"
        broker = [p for p in [listening_pid(_broker_port(broker_url))] if p is not None]
        try:
            with Processes(self.workdir) as procs:
                worker = self._worker(
                    procs,
                    "benchmarks.app_bare:app",
                    f"worker-{run}",
                    queue,
                    {**env, "BENCH_COUNTER": str(counter.path), "BENCH_READY": str(ready)},
                    pool=self.pool,
                    concurrency=self.concurrency,
                )
                wait_for(ready, [worker], 60)
                if warmup:
                    self._load(procs, "publish", env, counter, warmup, [worker])
                cpu0 = {
                    "worker": cpu_seconds(worker.tree()),
                    "worker.main": cpu_seconds(worker.tree()[:1]),
                    "broker": cpu_seconds(broker),
                }
                summary, done, last = self._load(procs, "publish", env, counter, n, [worker])
                cpu = {
                    "worker": cpu_seconds(worker.tree()) - cpu0["worker"],
                    "worker.main": cpu_seconds(worker.tree()[:1]) - cpu0["worker.main"],
                    "publisher": float(summary.get("cpu", 0.0)),
                    "broker": cpu_seconds(broker) - cpu0["broker"],
                }
        finally:
            counter.close()
            cleanup_queues(broker_url, [queue])
        started = float(summary["started"])
        return PipelineResult(
            kind="bare",
            broker=_broker_name(broker_url),
            n=n,
            seconds=last - started,
            send_seconds=float(summary["finished"]) - started,
            completed=done,
            cpu_ms_per_msg={k: 1000 * v / n for k, v in cpu.items()},
            settings={
                "prefetch": prefetch,
                "concurrency": self.concurrency,
                "pool": self.pool,
                "warmup": warmup,
            },
        )

    def outbox(
        self,
        broker_url: str,
        n: int,
        *,
        prefetch: int = 1,
        claim_interval: float = 1.0,
        batch_size: int = 200,
        producer_batch: int = 100,
        warmup: int = 2000,
        variant: str = "",
        tag: str = "",
        attach: Any = None,
        sample_rss: bool = False,
        rate: float | None = None,
        duration: float = 20.0,
        ordered_keys: int = 0,
        single_worker: bool = False,
        listen: bool = True,
        notify: bool = True,
        delay: float = 0.0,
        idle: float = 0.0,
        on_measured: Callable[[str], Any] | None = None,
        handler_batch: int = 0,
        delivery_workers: int = 1,
        extra_env: dict[str, str] | None = None,
    ) -> PipelineResult:
        """The outbox: a producer process committing events, beat, a claim worker, delivery workers.

        ``handler_batch`` makes the no-op handler a batch handler of that size.

        ``warmup`` messages go through first, unmeasured: worker pools start, prepared statements
        are in place, and the adaptive in-flight bound has seen the workers' throughput (it
        starts at ``batch_size`` per claim run and follows what finished in the last lease).
        ``attach(procs_by_role)`` is called once the workers are warm (the profiler uses it).
        With ``rate``, the measured producer commits one event per transaction at that steady
        rate for ``duration`` seconds instead (``n`` is ignored) and the result carries the
        commit -> handler start latencies (``extra["latency_s"]``, in commit order).

        ``single_worker`` runs the README's deployment instead: one prefork worker consuming the
        claim and the delivery queue, plus beat. ``listen``/``notify`` switch push off on
        the worker/producer side; ``delay`` gives every measured event that delay (the latency
        is then measured from its ``available_at``); ``idle`` seconds are spent with no load
        before the measured run, counting the claim tasks that went through the broker.
        ``on_measured(table)`` is called (after ``attach``) right before the measured load starts:
        the horizon benchmark starts its sampler and its pinned snapshot there.
        ``delivery_workers`` starts that many delivery workers of ``concurrency`` processes each
        (split deployment only); ``extra_env`` is added to every process's environment (the
        flow benchmark's limits and handler sleep, ``benchmarks/flow_celery.py``).
        """
        if rate is not None:
            n = int(rate * duration)
        run = f"{tag or 'outbox'}-{uuid.uuid4().hex[:6]}"
        table = f"bench_{run.replace('-', '_')}"
        queue, claim_queue = f"bench.deliver.{run}", f"bench.claim.{run}"
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            migrate(conn, table)
        counter = CompletionCounter.create(self.workdir / f"{run}.counter")
        env = {
            "BENCH_BROKER_URL": broker_url,
            "BENCH_DSN": self.dsn,
            "BENCH_TABLE": table,
            "BENCH_QUEUE": queue,
            "BENCH_CLAIM_QUEUE": claim_queue,
            "BENCH_PREFETCH": str(prefetch),
            "BENCH_CLAIM_INTERVAL": str(claim_interval),
            "BENCH_BATCH_SIZE": str(batch_size),
            "BENCH_PRODUCER_BATCH": str(producer_batch),
            "BENCH_VARIANT": variant,
            "BENCH_ORDERED_KEYS": str(ordered_keys),
            "BENCH_LISTEN": "1" if listen else "0",
            "BENCH_NOTIFY": "1" if notify else "0",
            "BENCH_DELAY": str(delay),
            "BENCH_HANDLER_BATCH": str(handler_batch),
            **(extra_env or {}),
        }
        latency_dir = self.workdir / f"{run}.latency"
        measured_env = dict(env)
        if rate is not None:
            latency_dir.mkdir()
            env["BENCH_LATENCY_DIR"] = str(latency_dir)
            measured_env.update(
                BENCH_RATE=str(rate), BENCH_DURATION=str(duration), BENCH_LATENCY_DIR=str(latency_dir)
            )
        app = "benchmarks.app_outbox:app"
        broker = [p for p in [listening_pid(_broker_port(broker_url))] if p is not None]
        rss_samples: list[tuple[int, int, int]] = []
        try:
            with Processes(self.workdir) as procs, psycopg.connect(self.dsn, autocommit=True) as admin:
                claim_runs = self.workdir / f"{run}.claims"
                env["BENCH_CLAIM_COUNTER"] = str(claim_runs)
                measured_env["BENCH_CLAIM_COUNTER"] = str(claim_runs)
                deliver = self._worker(
                    procs,
                    app,
                    f"deliver-{run}",
                    f"{claim_queue},{queue}" if single_worker else queue,
                    {
                        **env,
                        "BENCH_COUNTER": str(counter.path),
                        "BENCH_READY": str(self.workdir / f"{run}.d"),
                    },
                    pool=self.pool,
                    concurrency=self.concurrency,
                )
                more = [
                    self._worker(
                        procs,
                        app,
                        f"deliver{k}-{run}",
                        queue,
                        {
                            **env,
                            "BENCH_COUNTER": str(counter.path),
                            "BENCH_READY": str(self.workdir / f"{run}.d{k}"),
                        },
                        pool=self.pool,
                        concurrency=self.concurrency,
                    )
                    for k in range(1, delivery_workers if not single_worker else 1)
                ]
                for k in range(1, len(more) + 1):
                    wait_for(self.workdir / f"{run}.d{k}", [deliver, *more], 60)
                if single_worker:
                    claim = deliver
                    wait_for(self.workdir / f"{run}.d", [deliver], 60)
                else:
                    claim = self._worker(
                        procs,
                        app,
                        f"claim-{run}",
                        claim_queue,
                        {**env, "BENCH_READY": str(self.workdir / f"{run}.c")},
                        pool="solo",
                        concurrency=1,
                    )
                    wait_for(self.workdir / f"{run}.d", [deliver, claim], 60)
                    wait_for(self.workdir / f"{run}.c", [deliver, claim], 60)
                beat = procs.start(
                    f"beat-{run}",
                    celery_command(app, "beat", "-s", str(self.workdir / f"{run}.beat"), "-l", "WARNING"),
                    env,
                )
                roles = {"deliver": deliver, "claim": claim, "beat": beat}
                if single_worker:
                    roles = {"worker": deliver, "beat": beat}
                roles.update({f"deliver{k}": w for k, w in enumerate(more, start=1)})
                watch = list(roles.values())
                # Statistics before the warm-up and after every backend exited: backends report
                # theirs with a delay (at most once a second, or after 10 s idle, or on exit).
                pg0 = pg_counters(admin)
                if warmup:
                    self._load(procs, "produce", env, counter, warmup, watch)
                    # The table was created empty for this run, and the workers' connections
                    # cached the generic plans of their prepared statements while it was small:
                    # a sequential scan for the fenced start and finish, kept until the table's
                    # next ANALYZE (seconds to a minute later, or never in a run this short),
                    # which made PostgreSQL's CPU per message vary threefold between runs of
                    # the same code. Analyzed here, as autovacuum would a table in service, the
                    # measured load sees plans made from its statistics.
                    admin.execute(sql.SQL("ANALYZE {}").format(TableName.parse(table).identifier()))
                else:
                    time.sleep(1.0)  # beat up, first (empty) claims done
                idle_claims = None
                if idle:
                    time.sleep(1.0)  # the warm-up's last claims settle
                    before = _count_lines(claim_runs)
                    time.sleep(idle)
                    idle_claims = _count_lines(claim_runs) - before
                if attach is not None:
                    attach(roles)
                if on_measured is not None:
                    on_measured(table)
                cpu0 = {k: cpu_seconds(p.tree()) for k, p in roles.items()}
                main0 = cpu_seconds(deliver.tree()[:1])
                cpu0["broker"] = cpu_seconds(broker)
                backends0 = {p.pid: cpu_seconds([p]) for p in backend_pids(admin)}
                base, _ = counter.read()

                def tick(done: int) -> None:
                    done -= base
                    if sample_rss and (not rss_samples or rss_samples[-1][0] + max(1, n // 50) <= done):
                        rss_samples.append((done, rss_bytes(deliver.tree()), rss_bytes(claim.tree())))

                summary, done, last = self._load(procs, "produce", measured_env, counter, n, watch, tick)
                if sample_rss:
                    rss_samples.append((done, rss_bytes(deliver.tree()), rss_bytes(claim.tree())))
                cpu = {k: cpu_seconds(p.tree()) - cpu0[k] for k, p in roles.items()}
                # The delivery worker split: its main process (consumer, acks, timers) and its pool.
                cpu["deliver.main"] = cpu_seconds(deliver.tree()[:1]) - main0
                cpu["producer"] = float(summary.get("cpu", 0.0))
                cpu["broker"] = cpu_seconds(broker) - cpu0["broker"]
                cpu["postgres"] = sum(
                    cpu_seconds([p]) - backends0.get(p.pid, 0.0) for p in backend_pids(admin)
                )
                # A handled message's done may still wait in its worker process for its batch
                # (done_batch_delay): the run ends when the last outcome is recorded, not at the
                # last handler call.
                last = max(last, _recorded(admin, table, n + warmup))
                status: dict[str, int] = dict(
                    admin.execute(
                        # The horizon benchmark's churned rows (benchmarks.horizon) are not the run's.
                        sql.SQL(
                            "SELECT status, count(*) FROM {} WHERE event_type <> 'bench.churn'"
                            " GROUP BY status"
                        ).format(TableName.parse(table).identifier())
                    ).fetchall()
                )
                # Ordered runs: pairs of one key whose done order differs from id order.
                inversions = admin.execute(
                    sql.SQL(
                        "SELECT count(*) FROM {t} AS a JOIN {t} AS b"
                        " ON a.ordering_key = b.ordering_key AND a.id < b.id AND a.done_at >= b.done_at"
                    ).format(t=TableName.parse(table).identifier())
                ).fetchone()
                available: dict[int, float] = {}
                if delay and rate is not None:
                    available = {
                        int(i): float(t)
                        for i, t in admin.execute(
                            sql.SQL("SELECT id, extract(epoch FROM available_at)::float8 FROM {}").format(
                                TableName.parse(table).identifier()
                            )
                        ).fetchall()
                    }
                procs.stop_all()
                time.sleep(0.5)  # exiting backends flush their statistics
                pg1 = pg_counters(admin)
        finally:
            counter.close()
            cleanup_queues(broker_url, [queue, claim_queue])
            drop_table(self.dsn, table)
        started = float(summary["started"])
        db = db_per_message(pg0, pg1, n + warmup)
        result = PipelineResult(
            kind="outbox",
            broker=_broker_name(broker_url),
            n=n,
            seconds=last - started,
            send_seconds=float(summary["finished"]) - started,
            completed=done,
            cpu_ms_per_msg={k: 1000 * v / n for k, v in cpu.items()},
            db_per_msg=db,
            settings={
                "prefetch": prefetch,
                "concurrency": self.concurrency,
                "pool": self.pool,
                "claim_interval": claim_interval,
                "batch_size": batch_size,
                "producer_batch": producer_batch,
                "warmup": warmup,
                "variant": variant or "current",
                "single_worker": single_worker,
                "listen": listen,
                "notify": notify,
                "handler_batch": handler_batch,
                "delivery_workers": delivery_workers,
            },
            extra={
                "status": status,
                "inversions": inversions[0] if inversions else None,
                "idle_seconds": idle,
                "idle_claim_tasks": idle_claims,
            },
        )
        if status.get("done", 0) != n + warmup:
            raise RuntimeError(f"outbox run finished with rows {status}, expected {n + warmup} done")
        if rss_samples:
            result.rss = {"samples": rss_samples}
        if rate is not None:
            result.extra["latency_s"] = _latencies(latency_dir, available)
            result.extra["producer_late"] = summary.get("late", 0)
            result.extra["offered_rate"] = rate
        return result


def _count_lines(path: Path) -> int:
    try:
        return len(path.read_text().splitlines())
    except FileNotFoundError:
        return 0


def _times(paths: list[Path]) -> dict[int, float]:
    """``{id: earliest time}`` from ``"<id> <time>"`` lines."""
    times: dict[int, float] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            i, t = line.split()
            times[int(i)] = min(float(t), times.get(int(i), float("inf")))
    return times


def _latencies(folder: Path, available: dict[int, float] | None = None) -> dict[str, list[float]]:
    """Per message, in commit order: commit -> handler start, and its two legs.

    With ``available`` (delayed events: id -> ``available_at``), ``total`` and ``claim_wait``
    are measured from ``available_at`` instead of the commit.

    ``commit``: the commit time (``time.time()``, or ``available_at``) of each message, in order;
    ``claim_wait``: commit -> its claim run finished publishing; ``hop``: published -> handler
    start (broker, worker, fenced start).
    """
    commits = _times([folder / "commits.txt"])
    starts = _times(sorted(folder.glob("start-*.txt")))
    published = _times(sorted(folder.glob("published-*.txt")))
    missing = set(commits) - set(starts)
    if missing:
        raise RuntimeError(f"{len(missing)} committed messages never started")
    order = sorted(commits, key=commits.__getitem__)
    if available:
        commits = {i: available[i] for i in commits}
    return {
        "commit": [commits[i] for i in order],
        "total": [starts[i] - commits[i] for i in order],
        "claim_wait": [published[i] - commits[i] for i in order if i in published],
        "hop": [starts[i] - published[i] for i in order if i in published],
    }


def _recorded(admin: psycopg.Connection[Any], table: str, expected: int, timeout: float = 10.0) -> float:
    """Wall-clock time (``time.time()``) the last of ``expected`` rows went ``done``.

    Waits up to ``timeout`` for dones still held by the workers' batches; 0.0 if none is done.
    """
    ident = TableName.parse(table).identifier()
    deadline = time.monotonic() + timeout
    while True:
        done, at = admin.execute(
            sql.SQL(
                "SELECT count(*), extract(epoch FROM max(done_at))::float8 FROM {}"
                " WHERE status = 'done' AND event_type <> 'bench.churn'"
            ).format(ident)
        ).fetchone() or (0, None)
        if done >= expected or time.monotonic() > deadline:
            return float(at or 0.0)
        time.sleep(0.05)
