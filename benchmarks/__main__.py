"""``python -m benchmarks`` (``make bench``): every figure beside a baseline measured in the same run.

Sections (``--only`` picks some):

* ``plain``: the plain dispatcher loop (no Celery), current store beside the legacy store, and
  what the database sees per delivered message (round trips, transactions).
* ``e2e``: end-to-end outbox messages/s beside bare Celery no-op tasks/s, same broker, pool,
  concurrency and prefetch, per broker (Redis, RabbitMQ), interleaved and repeated.
* ``latency``: commit -> handler start percentiles on the README deployment, push beside
  beat-only, at 50 events/s and at half the maximum measured there, per broker; idle claim
  tasks through the broker; delayed events against their ``available_at``; what NOTIFY costs
  8 concurrent producers.
* ``claim``: claim batch latency and rows/s with little and with much history; the ordered claim
  as the number of ordering keys grows (10 to 200,000, and most heads in flight) beside the
  unordered claim and the skip-scan claim; enqueue cost of ordered beside unordered events.
* ``wins`` (opt-in): end-to-end variants: the legacy store, prefetch 4, early acks.
* ``profile`` (opt-in): py-spy on an end-to-end run; where the time goes.
* ``ordered`` (opt-in): end to end, ``--ordered-keys`` keys x 2 ordered events drained beside
  the same number of unordered events (Redis), with the inversions counted.
* ``soak`` (opt-in, ``--soak N``): worker and claim-process memory over N messages.
* ``horizon`` (opt-in): on a private PostgreSQL with stock settings (autovacuum on; the
  installed PostgreSQL's initdb on a free port, else the embedded one; ``--dsn`` for another stock
  server), both of:

  * ``horizon-load``: the README deployment at a steady ``--horizon-rate`` (200 events/s, one per
    transaction), without a pin and with a REPEATABLE READ snapshot held ``--pin-seconds`` (120;
    a comma-separated list runs one pinned run each) after ``--horizon-warmup`` (60 s) and before
    ``--horizon-tail`` (60 s): per 10-s window p50/p99 commit -> handler start, starts, unfinished
    rows, dead tuples; per run the goals (pinned p99 <= 250 ms and <= 3x before; unfinished <=
    one second of production). ``--horizon-churn N`` churns N dead versions in when the pin is
    taken (a long pin's state in a minute), ``--horizon-variants`` reruns each pinned run with
    benchmark variants beside it (``fenced_status,expired_each,index_sampler``: the code and
    sampler before the 30-minute pin's fix), ``--horizon-readers N`` adds REPEATABLE READ
    readers scanning the table every 0.1 s and reports their backends' CPU.
  * ``horizon-claim``: one claim of ``--batch-size`` rows (one Store reused, median of
    ``--horizon-claims``) with 0 and ``--horizon-dead`` (100k, 500k) dead versions in front of it.
* ``batch`` (opt-in): end to end, batch handlers of ``--handler-batches`` (50, 100) beside
  bare Celery's per-message rate and the outbox's one-message handler, same broker, pool,
  concurrency and prefetch, per deployment, alternated for ``--batch-rounds`` (3) rounds, medians.
* ``flow`` (opt-in): flow control with real workers (3 workers x prefork 4 and a claim
  worker, Redis): a concurrency limit's most handlers at once and rate (with and without the
  freed-slot wake), a rate limit's 1-s windows, the cost of limits that do not bind; the
  defaults of ``python -m benchmarks.flow_celery`` (its options there).
* ``flow-bounds`` (opt-in): ``python -m benchmarks.flow --only held cap``: one claim of 200
  rows beside 50,000 paused or held limit keys and claim runs per second while a key sits at its
  ``key_concurrency``, each beside its baseline from the same run (DESIGN invariant 25).
* ``transactional`` (opt-in): the plain loop with a handler that inserts one effect row,
  transactional (effect and done in one transaction) beside plain (the effect on its own
  connection, then the done), interleaved twice.

* ``groups`` (opt-in): ``python -m benchmarks.groups``: a member of a group with a callback
  (DESIGN invariant 29) beside the same message without a group, written, claimed, started and
  done one row at a time (no Celery), alternated rounds; and the last member's finalize (which
  enqueues the callback) beside another member's.

* ``databases`` (opt-in, DESIGN invariant 34): ``python -m benchmarks.databases`` with its defaults
  (``--quick``: its ``--short``): one Outbox over 100 databases of a private stock PostgreSQL, 20
  producing 10 msg/s each, on the README deployment: per-database p99 commit -> handler start,
  the idle databases' claims and the worker's connections; one database unavailable for 60 s
  (the others' p99 during it, the stopped one's rows all delivered); one database at 500 msg/s
  beside 19 at 5 msg/s. Each beside one database alone (``dsn=``) at the same rate.

* ``peer`` (opt-in): the nearest peer, django-celery-outbox (installed into its own virtual
  environment on first use, left out with a line saying why when it cannot be), with its relay's
  defaults and tuned (``--batch-size 500 --idle-time 0.1``), beside bare Celery and ours on both
  deployments, alternated ``--repeat`` times per broker; same handler, worker flags and producer
  transactions of ``--producer-batch``.

* ``subscriptions`` (opt-in, DESIGN invariant 28): ``python -m benchmarks.subscriptions``: the
  producer's transaction of one event with 1, 3 and 10 subscriptions beside the insert before
  subscriptions (one event, one handler), interleaved; median, p90, table and WAL bytes per event;
  then end to end (Redis) three subscriptions with one failing every delivery beside none failing.

Results are printed as tables and written as JSON to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

from outbox_celery import OutboxConfig
from outbox_celery.dsn import redact
from outbox_celery.testing import temporary_database

from .claimcost import (
    ENQUEUE_KINDS,
    ClaimCost,
    KeysCost,
    build_history,
    build_table,
    measure_claim_cost,
    measure_enqueue,
    measure_keys,
)
from .horizon import StockServer, measure_claim_vs_dead, run_scenario, stock_server
from .measure import percentile
from .peer import PeerRun, peer_python
from .pipeline import Pipeline, PipelineResult, drop_table
from .plain import PlainResult, run_plain
from .producer_cost import producer_rate
from .profiling import Profiler
from .report import Report
from .services import Services, services
from .transactional import CONNECTION_HANDLING, EffectResult, run_effect
from .variants import make_store

RESULTS = Path(__file__).resolve().parent / "results"
SECTIONS = (
    "plain",
    "e2e",
    "latency",
    "claim",
    "wins",
    "profile",
    "soak",
    "ordered",
    "horizon",
    "horizon-load",
    "horizon-claim",
    "transactional",
    "peer",
    "batch",
    "flow",
    "flow-bounds",
    "subscriptions",
    "groups",
    "databases",
)
DEFAULT_SECTIONS = ("plain", "e2e", "latency", "claim")
# The end-to-end deployments: a solo claim worker beside the delivery worker, and the README's
# one worker consuming both queues (its main process claims on notifications).
DEPLOYMENTS = {
    "split": "split (claim worker + delivery worker)",
    "readme": "README (one worker -Q claim,deliver)",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="outbox-celery benchmarks: each figure beside a baseline measured in the same run.",
    )
    p.add_argument("--dsn", help="PostgreSQL server (maintenance DB); a throw-away database is created on it")
    p.add_argument(
        "--redis-url", help="Redis broker (default: 127.0.0.1:6379/15 if reachable, else embedded)"
    )
    p.add_argument(
        "--amqp-url", help="RabbitMQ broker (default: guest@127.0.0.1:5672 if reachable, else skipped)"
    )
    p.add_argument(
        "--brokers",
        default="redis,rabbitmq",
        help="brokers for the end-to-end runs (default: redis,rabbitmq)",
    )
    p.add_argument("--only", help=f"comma-separated sections among {', '.join(SECTIONS)}")
    p.add_argument(
        "--wins", action="store_true", help="also run end-to-end variants (legacy store, prefetch 4, acks)"
    )
    p.add_argument(
        "--peer", action="store_true", help="also compare with django-celery-outbox (installed on first use)"
    )
    p.add_argument("--profile", action="store_true", help="also profile an end-to-end run with py-spy")
    p.add_argument(
        "--profile-pack",
        type=int,
        default=0,
        metavar="N",
        help="profile section: the handler declared with pack=N (DESIGN invariant 30; default 0: none)",
    )
    p.add_argument(
        "--soak", type=int, metavar="N", help="also run N messages end to end and watch memory (100000)"
    )
    p.add_argument(
        "-n", "--messages", type=int, default=5000, help="messages per end-to-end run (default 5000)"
    )
    p.add_argument(
        "--repeat", type=int, default=2, help="interleaved bare/outbox pairs per broker (default 2)"
    )
    p.add_argument(
        "--concurrency", type=int, default=2, help="worker concurrency, both pipelines (default 2)"
    )
    p.add_argument(
        "--prefetch", type=int, default=1, help="worker prefetch multiplier, both pipelines (default 1)"
    )
    p.add_argument(
        "--peer-packs",
        default="8",
        help="peer section: also run our handler declared with each of these pack= sizes (comma "
        "separated; empty for none), alternated with the rest (DESIGN invariant 30)",
    )
    p.add_argument(
        "--deployments",
        default="split,readme",
        help="end-to-end deployments: split (claim worker + delivery worker), readme (one worker)",
    )
    p.add_argument(
        "--e2e-variants",
        help="also run these benchmark variants (';'-separated specs, see benchmarks/variants.py) "
        "in every deployment, interleaved",
    )
    p.add_argument("--pool", default="prefork", help="worker pool, both pipelines (default prefork)")
    p.add_argument(
        "--claim-interval", type=float, default=1.0, help="outbox claim_interval, seconds (default 1.0)"
    )
    p.add_argument(
        "--warmup", type=int, default=2000, help="unmeasured messages before each end-to-end run (2000)"
    )
    p.add_argument("--batch-size", type=int, default=200, help="outbox batch_size (default 200)")
    p.add_argument(
        "--handler-batches", default="50,100", help="batch handler sizes of the batch section (50,100)"
    )
    p.add_argument("--batch-rounds", type=int, default=3, help="alternated rounds of the batch section (3)")
    p.add_argument(
        "--producer-batch", type=int, default=100, help="events per producer transaction (default 100)"
    )
    p.add_argument(
        "--plain-messages", type=int, default=5000, help="messages per plain-loop run (default 5000)"
    )
    p.add_argument("--latency-duration", type=float, default=20.0, help="seconds of steady load (default 20)")
    p.add_argument("--latency-rate", type=float, default=50.0, help="the fixed latency load, events/s (50)")
    p.add_argument("--latency-idle", type=float, default=20.0, help="seconds of idle broker traffic (20)")
    p.add_argument("--latency-delay", type=float, default=2.0, help="delay of the delayed events, s (2)")
    p.add_argument("--latency-producers", type=int, default=8, help="concurrent producers (8)")
    p.add_argument("--latency-producer-seconds", type=float, default=5.0, help="seconds per producer run (5)")
    p.add_argument("--latency-producer-repeat", type=int, default=3, help="producer runs per setting (3)")
    p.add_argument(
        "--latency-load",
        type=float,
        default=0.5,
        help="offered load as a share of the measured maximum (0.5)",
    )
    p.add_argument("--claim-small", type=int, default=10_000, help="finished rows in the small table (10k)")
    p.add_argument("--claim-large", type=int, default=1_000_000, help="finished rows in the large table (1M)")
    p.add_argument("--claim-pending", type=int, default=100_000, help="pending rows in both tables (100k)")
    p.add_argument("--claim-batches", type=int, default=50, help="timed claim batches per table (50)")
    p.add_argument(
        "--claim-keys",
        default="10,1000,50000,200000",
        help="ordering keys of the keys dimension, comma-separated (10,1000,50000,200000)",
    )
    p.add_argument(
        "--claim-ordered", type=int, default=100_000, help="unfinished ordered rows per keys case (100k)"
    )
    p.add_argument(
        "--claim-in-flight",
        default="49000/50000",
        help="heads in flight / keys of the blocked case, empty to leave it out (49000/50000)",
    )
    p.add_argument(
        "--claim-before-batches", type=int, default=3, help="timed skip-scan claims per keys case (3)"
    )
    p.add_argument(
        "--ordered-keys",
        type=int,
        default=50_000,
        help="keys of the ordered end-to-end run, 2 events each (50k)",
    )
    p.add_argument("--enqueue-n", type=int, default=500, help="timed enqueue transactions per kind (500)")
    p.add_argument("--horizon-rate", type=float, default=200.0, help="horizon: offered load, events/s (200)")
    p.add_argument(
        "--pin-seconds",
        default="120",
        help="horizon: pinned snapshot lengths, one pinned run each, comma-separated (120; 360 long)",
    )
    p.add_argument(
        "--horizon-warmup", type=float, default=60.0, help="horizon: seconds of load before the pin (60)"
    )
    p.add_argument(
        "--horizon-tail", type=float, default=60.0, help="horizon: seconds of load after the pin (60)"
    )
    p.add_argument("--horizon-window", type=float, default=10.0, help="horizon: window length, s (10)")
    p.add_argument(
        "--horizon-baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="horizon: also the same run without a pin (default on)",
    )
    p.add_argument(
        "--horizon-dead",
        default="100000,500000",
        help="horizon-claim: dead versions in front of the claim, comma-separated (100000,500000)",
    )
    p.add_argument(
        "--horizon-purge",
        type=int,
        default=0,
        help="horizon: also a run where the retention purge deletes this many week-old done rows at the pin's"
        " time (0: off)",
    )
    p.add_argument(
        "--horizon-churn",
        type=int,
        default=0,
        help="horizon-load: dead versions churned into the table when the pin is taken, to reach a long"
        " pin's dead versions in seconds (0: off)",
    )
    p.add_argument(
        "--horizon-readers",
        type=int,
        default=0,
        help="horizon-load: REPEATABLE READ readers scanning the table every 0.1 s during the pin, their"
        " backends' CPU reported (0: off; the harness's 'active readers' use 4)",
    )
    p.add_argument(
        "--horizon-variants",
        default="",
        help="horizon-load: also run every pinned run with these benchmark variants (';'-separated specs,"
        " see benchmarks/variants.py; e.g. 'expired_each,index_sampler' for the code and sampler before"
        " first_expired)",
    )
    p.add_argument("--horizon-claims", type=int, default=7, help="horizon-claim: timed claims per level (7)")
    p.add_argument(
        "--horizon-churn-batch", type=int, default=10_000, help="horizon-claim: rows per churn step (10k)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="small sizes: a smoke run of every default section (and of horizon, when chosen)",
    )
    p.add_argument(
        "--json", type=Path, help="write results here (default benchmarks/results/bench-<time>.json)"
    )
    return p


def _sections(args: argparse.Namespace) -> list[str]:
    chosen = list(DEFAULT_SECTIONS)
    if args.only:
        chosen = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = set(chosen) - set(SECTIONS)
        if unknown:
            raise SystemExit(f"unknown section(s): {', '.join(sorted(unknown))}")
    if args.wins and "wins" not in chosen:
        chosen.append("wins")
    if args.peer and "peer" not in chosen:
        chosen.append("peer")
    if args.profile and "profile" not in chosen:
        chosen.append("profile")
    if args.soak and "soak" not in chosen:
        chosen.append("soak")
    return chosen


def _brokers(args: argparse.Namespace, svc: Services) -> list[tuple[str, str]]:
    out = []
    for name in (b.strip() for b in args.brokers.split(",") if b.strip()):
        if name == "redis":
            out.append(("redis", svc.redis_url))
        elif name in ("rabbitmq", "amqp"):
            if svc.amqp_url:
                out.append(("rabbitmq", svc.amqp_url))
        else:
            raise SystemExit(f"unknown broker {name!r}: use redis and/or rabbitmq")
    return out


#: Roles of a pipeline that are worker-side processes (CPU per message tables).
_WORKER_ROLES = ("worker", "relay", "deliver", "claim", "beat")


def _keep_logs(workdir: Path, section: str, since: float) -> Path | None:
    """Copy the processes' logs of a failed section (those written since it began, at ``since``
    on the wall clock) out of the run's temporary directory."""
    logs = sorted(p for p in workdir.rglob("*.log") if p.stat().st_mtime >= since)
    if not logs:
        return None
    dest = RESULTS / f"failed-{section}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    dest.mkdir(parents=True, exist_ok=True)
    for log in logs:
        shutil.copy2(log, dest / "_".join(log.relative_to(workdir).parts))
    return dest


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


class Bench:
    """One invocation: services, settings, results."""

    def __init__(self, args: argparse.Namespace, svc: Services, workdir: Path, report: Report) -> None:
        self.args = args
        self.svc = svc
        self.workdir = workdir
        self.report = report
        self.pipeline = Pipeline(svc.dsn, workdir, concurrency=args.concurrency, pool=args.pool)
        self.results: dict[str, Any] = {}
        self.max_rate: dict[str, float] = {}
        self.stack = contextlib.ExitStack()
        self._stock: tuple[StockServer, str] | None = None

    def close(self) -> None:
        """Stop what the sections started for themselves (the horizon sections' server)."""
        self.stack.close()

    def flow(self) -> None:
        """Flow control with real workers: ``benchmarks/flow_celery.py`` with its defaults."""
        from .flow_celery import PARTS, parser, run_parts

        self.report.flush()
        run_parts(parser().parse_args([]), self.svc.dsn, self.svc.redis_url, self.workdir, PARTS)

    def flow_bounds(self) -> None:
        """Flow control's bounds (DESIGN invariant 25): ``benchmarks/flow.py``'s held and cap
        parts, each beside its baseline from the same run."""
        from outbox_celery import migrate

        from .flow import claim_runs_at_cap, held_cost

        with psycopg.connect(self.svc.dsn, autocommit=True) as conn:
            migrate(conn, "cap")
        held = 50_000
        cost = held_cost(self.svc.dsn, rounds=20, keys=1000, held=held)
        t = self.report.table(
            f"Claim of 200 rows over 1,000 limit keys beside {held:,} paused or held keys (median of 20)",
            ["figure", "value", "baseline (none held)", "ratio", "rows claimed"],
        )
        for variant in ("key_concurrency (not binding)", "no limit"):
            for which in (f"{held:,} held", f"{held:,} held, no row waiting"):
                (many, got), (none, base) = cost[f"{variant}, {which}"], cost[f"{variant}, none held"]
                t.row(
                    f"{variant}; {which}",
                    f"{many:.2f} ms",
                    f"{none:.2f} ms",
                    f"{many / none:.2f}x",
                    f"{got:.0f} vs {base:.0f}",
                )
        now = claim_runs_at_cap(self.svc.dsn, "cap", seconds=5.0, recheck=None)
        before = claim_runs_at_cap(self.svc.dsn, "cap", seconds=5.0, recheck=0.05)
        t = self.report.table(
            "Claim runs per second, one key at key_concurrency=1, nothing finishing (5 s)",
            ["figure", "value", "baseline (50 ms recheck)", "ratio"],
        )
        t.row("claim runs/s", f"{now:.1f}", f"{before:.1f}", f"{now / before:.2f}x")
        self.report.flush()
        self.results["flow-bounds"] = {
            "claim_ms": cost,
            "runs_per_second": now,
            "runs_per_second_50ms": before,
        }

    def subscriptions(self) -> None:
        """The producer's cost of subscriptions (DESIGN invariant 28): benchmarks/subscriptions.py."""
        from .subscriptions import e2e_rounds, producer_cost, report, report_e2e

        cost = producer_cost(self.svc.dsn)
        report(cost, self.report, server="the benchmark's server")
        runs = e2e_rounds(self.svc.dsn, self.svc.redis_url, self.workdir, rate=15.0, seconds=15.0, rounds=2)
        report_e2e(runs, self.report, rate=15.0, seconds=15.0, server="Redis, medians of 2 rounds")
        self.results["subscriptions"] = {"producer": {str(n): r for n, r in cost.items()}, "e2e": runs}

    def _outbox(self, broker_url: str, n: int, **kw: Any) -> PipelineResult:
        a = self.args
        kw.setdefault("prefetch", a.prefetch)
        return self.pipeline.outbox(
            broker_url,
            n,
            claim_interval=kw.pop("claim_interval", a.claim_interval),
            batch_size=a.batch_size,
            producer_batch=a.producer_batch,
            warmup=a.warmup,
            **kw,
        )

    def _bare(self, broker_url: str, n: int, **kw: Any) -> PipelineResult:
        kw.setdefault("prefetch", self.args.prefetch)
        return self.pipeline.bare(broker_url, n, warmup=min(self.args.warmup, 1000), **kw)

    # -- sections ------------------------------------------------------------------------------

    def plain(self) -> None:
        a = self.args
        rows: list[PlainResult] = []
        for label, variant in (
            ("current", ""),
            ("legacy", "legacy"),
            ("current-2", ""),
            ("legacy-2", "legacy"),
        ):
            rows.append(
                run_plain(
                    self.svc.dsn,
                    a.plain_messages,
                    label=label,
                    store=make_store(f"bench_plain_{label.replace('-', '_')}", variant),
                    batch_size=a.batch_size,
                )
            )
        current = _median([r.rate for r in rows if not r.label.startswith("legacy")])
        before = _median([r.rate for r in rows if r.label.startswith("legacy")])
        traced = {
            label: run_plain(
                self.svc.dsn,
                min(1000, a.plain_messages),
                label=f"trace-{label}",
                store=make_store(f"bench_plain_trace_{label.replace('-', '_')}", variant),
                batch_size=a.batch_size,
                trace=True,
            )
            for label, variant in (("current", ""), ("legacy", "legacy"))
        }
        self.results["plain"] = {
            "runs": [asdict(r) | {"rate": r.rate} for r in rows],
            "traced": {k: asdict(v) for k, v in traced.items()},
            "rate_current": current,
            "rate_before": before,
        }
        self.max_rate["plain"] = current
        t = self.report.table(
            "Plain dispatcher loop (1 process: claim -> no-op publish -> start -> no-op -> done; no Celery)",
            ["figure", "value", "baseline", "ratio"],
        )
        t.row(
            "messages/s, store vs the legacy store",
            f"{current:,.0f}",
            f"{before:,.0f}",
            f"{current / before:.2f}x",
        )
        cur, old = traced["current"], traced["legacy"]
        t.row(
            "DB round trips per delivered message",
            f"{cur.per_msg['round_trips']:.2f}",
            f"{old.per_msg['round_trips']:.2f}",
            f"{cur.per_msg['round_trips'] / old.per_msg['round_trips']:.2f}x",
        )
        t.row(
            "transactions (xact_commit) per delivered message",
            f"{cur.per_msg['transactions']:.2f}",
            f"{old.per_msg['transactions']:.2f}",
            "",
        )
        t.note(
            "round trips by step, per message (store | legacy store): "
            + ", ".join(
                f"{k} {cur.round_trips_by_step.get(k, 0):.3f}|{old.round_trips_by_step.get(k, 0):.3f}"
                for k in sorted(set(cur.round_trips_by_step) | set(old.round_trips_by_step))
            )
        )
        t.note(
            f"{a.plain_messages} messages per run, batch_size {a.batch_size}, runs interleaved twice; "
            "the traced runs (1000 messages) count round trips from libpq's protocol trace"
        )

    def databases(self) -> None:
        """Several databases, one Outbox: ``benchmarks/databases.py`` with its defaults (its
        ``--short`` with ``--quick``), on its own private stock server unless ``--dsn``."""
        from .databases import parser, run

        self.report.flush()
        args = parser().parse_args(["--short"] if self.args.quick else [])
        self.results["databases"] = run(args, self.args.dsn, self.svc.redis_url, self.workdir, self.report)

    def groups(self) -> None:
        from .groups import measure

        messages, size, rounds = 5000, 50, 5
        result = measure(self.svc.dsn, messages, size, rounds)
        m = result["medians"]
        t = self.report.table(
            f"A group's member (groups of {size}, with their callbacks) beside the same message without "
            f"a group: {messages} messages written, claimed, started and done one row at a time "
            f"(no Celery), median of {rounds} alternated rounds",
            ["figure", "grouped", "baseline (no group)", "ratio"],
        )
        for figure in m["grouped"]:
            new, base = m["grouped"][figure], m["without group"][figure]
            t.row(figure, f"{new:.1f}", f"{base:.1f}", f"{new / base:.2f}x")
        t.row(
            "finalize ms: last member (enqueues the callback) vs another member",
            f"{result['last_member_done_ms']:.3f}",
            f"{result['member_done_ms']:.3f}",
            f"{result['last_member_done_ms'] / result['member_done_ms']:.2f}x",
        )
        w = result["wake_to_claim_ms"]
        t.row(
            "last member's done -> a listening claim returns the callback, p99 ms",
            f"{w['p99']:.2f}",
            "-",
            "-",
        )
        self.report.flush()
        self.results["groups"] = result

    def transactional(self) -> None:
        a = self.args
        runs: list[EffectResult] = []
        # The library's transactional handler (its connection reset after each run), the two
        # other ways its connection could go back to the pool, and the plain handler.
        variants = [(True, h) for h in CONNECTION_HANDLING] + [(False, "library")]
        for i in (1, 2):
            for tx, handling in variants:
                label = f"{'tx-' + handling if tx else 'plain'}-{i}"
                runs.append(
                    run_effect(
                        self.svc.dsn,
                        a.plain_messages,
                        label=label,
                        transactional=tx,
                        batch_size=a.batch_size,
                        handling=handling,
                    )
                )

        def rate(tx: bool, handling: str = "library") -> float:
            return _median([r.rate for r in runs if r.transactional is tx and r.handling == handling])

        tx_rate, plain_rate = rate(True), rate(False)
        self.results["transactional"] = {
            "runs": [asdict(r) | {"rate": r.rate} for r in runs],
            "rate_transactional": tx_rate,
            "rate_plain": plain_rate,
            "rate_transactional_kept": rate(True, "kept"),
            "rate_transactional_discarded": rate(True, "discarded"),
        }
        t = self.report.table(
            "Transactional handler vs a plain handler doing the same write on its own connection "
            "(plain loop, 1 process, no Celery)",
            ["figure", "value", "baseline", "ratio"],
        )
        t.row(
            "messages/s, transactional vs plain",
            f"{tx_rate:,.0f}",
            f"{plain_rate:,.0f}",
            f"{tx_rate / plain_rate:.2f}x",
        )
        for handling in ("kept", "discarded"):
            other = rate(True, handling)
            t.row(
                f"messages/s, transactional: connection reset vs {handling}",
                f"{tx_rate:,.0f}",
                f"{other:,.0f}",
                f"{tx_rate / other:.2f}x",
            )
        t.note(
            f"{a.plain_messages} messages per run, batch_size {a.batch_size}, runs interleaved twice; "
            "the library resets the connection (one round trip); 'kept' hands it back as the handler "
            "left it (unsafe, the baseline before invariant 20 said so), 'discarded' closes it after "
            "every run; "
            f"effect rows per run: {', '.join(f'{r.label} {r.effects}' for r in runs)}"
        )

    def batch(self) -> None:
        """Batch handlers end to end, alternated with bare Celery and the one-message handler."""
        a = self.args
        sizes = [int(s) for s in a.handler_batches.split(",") if s.strip()]
        deployments = [d.strip() for d in a.deployments.split(",") if d.strip()]
        t = self.report.table(
            f"Batch handlers vs bare Celery per message ({a.messages} messages, {a.pool} x{a.concurrency}, "
            f"prefetch {a.prefetch}, batch_size {a.batch_size})",
            ["broker", "deployment", "pipeline", "msg/s", "bare Celery msg/s", "ratio", "goal >= 2x"],
        )
        out: dict[str, Any] = {}
        for broker, url in _brokers(a, self.svc):
            for dep in deployments:
                bare: list[PipelineResult] = []
                runs: dict[int, list[PipelineResult]] = {}
                for _ in range(a.batch_rounds):
                    # Alternated: bare, the one-message handler (0), then each batch size.
                    bare.append(self._bare(url, a.messages))
                    for size in [0, *sizes]:
                        runs.setdefault(size, []).append(
                            self._outbox(url, a.messages, single_worker=dep == "readme", handler_batch=size)
                        )
                b = _median([r.rate for r in bare])
                data: dict[str, Any] = {"bare": [r.rate for r in bare], "bare_rate": b}
                for size, rs in runs.items():
                    o = _median([r.rate for r in rs])
                    name = f"batch={size}" if size else "one-message handler"
                    data[name] = {
                        "rates": [r.rate for r in rs],
                        "rate": o,
                        "ratio": o / b,
                        "status": [r.extra.get("status") for r in rs],
                        "cpu_ms_per_msg": sorted(rs, key=lambda r: r.rate)[len(rs) // 2].cpu_ms_per_msg,
                    }
                    t.row(
                        broker,
                        DEPLOYMENTS.get(dep, dep),
                        name,
                        f"{o:,.0f}",
                        f"{b:,.0f}",
                        f"{o / b:.2f}x",
                        ("met" if o / b >= 2 else "MISSED") if size else "",
                    )
                out[f"{broker}/{dep}"] = data
        self.results["batch"] = out
        t.note(
            f"rounds alternate bare, the one-message handler and each batch size, {a.batch_rounds} rounds, "
            "medians shown; every run ends with every row done (checked), warm-up excluded; "
            f"claim_interval {a.claim_interval}s, push on, producer commits {a.producer_batch} events per "
            "transaction; a batch is cut from one claim (at most batch_size rows)"
        )

    def e2e(self) -> None:
        a = self.args
        out: dict[str, Any] = {}
        deployments = [d.strip() for d in a.deployments.split(",") if d.strip()]
        unknown = set(deployments) - set(DEPLOYMENTS)
        if unknown:
            raise SystemExit(f"unknown deployment(s): {', '.join(sorted(unknown))}")
        variants = [v.strip() for v in (a.e2e_variants or "").split(";") if v.strip()]
        t = self.report.table(
            f"End to end vs bare Celery ({a.messages} messages, {a.pool} x{a.concurrency}, "
            f"prefetch {a.prefetch}, producer and workers at the same time)",
            ["broker", "deployment", "outbox msg/s", "bare Celery msg/s", "ratio", "target >= 0.8x"],
        )
        for broker, url in _brokers(a, self.svc):
            bare: list[PipelineResult] = []
            outbox: dict[str, list[PipelineResult]] = {}
            for _ in range(a.repeat):
                # Interleaved: bare, then every deployment (and variant) once, then again.
                bare.append(self._bare(url, a.messages))
                for dep in deployments:
                    for variant in ["", *variants]:
                        key = dep if not variant else f"{dep} [{variant}]"
                        outbox.setdefault(key, []).append(
                            self._outbox(url, a.messages, single_worker=dep == "readme", variant=variant)
                        )
            b = _median([r.rate for r in bare])
            out[broker] = {"bare": [asdict(r) | {"rate": r.rate} for r in bare], "bare_rate": b}
            for key, runs in outbox.items():
                o = _median([r.rate for r in runs])
                if key == deployments[0]:
                    self.max_rate[broker] = o
                ratio = o / b
                t.row(
                    broker,
                    DEPLOYMENTS.get(key, key),
                    f"{o:,.0f}",
                    f"{b:,.0f}",
                    f"{ratio:.2f}x",
                    "met" if ratio >= 0.8 else "MISSED",
                )
                out[broker][key] = {
                    "runs": [asdict(r) | {"rate": r.rate} for r in runs],
                    "outbox_rate": o,
                    "ratio": ratio,
                }
        self.results["e2e"] = out
        if "plain" in self.max_rate and "redis" in self.max_rate:
            t.note(
                f"plain loop {self.max_rate['plain']:,.0f} msg/s vs outbox over Celery+Redis "
                f"{self.max_rate['redis']:,.0f} msg/s: the Celery hop costs "
                f"{self.max_rate['plain'] / self.max_rate['redis']:.1f}x"
            )
        t.note(
            f"runs alternate bare/outbox deployments, {a.repeat} of each, medians shown; "
            "split: a solo claim worker and a delivery worker; readme: one worker -Q claim,deliver "
            f"(the README's deployment); both with beat, claim_interval {a.claim_interval}s, "
            f"batch_size {a.batch_size}, push on; producer commits {a.producer_batch} events per transaction"
        )
        cpu = self.report.table(
            "CPU ms per message by process (median run; 2 cores = 2000 ms of CPU per second)",
            ["pipeline", "broker", "roles (ms/msg)", "total"],
        )
        for broker, data in out.items():
            for kind, runs in [("bare", data["bare"])] + [
                (k, v["runs"]) for k, v in data.items() if isinstance(v, dict) and "runs" in v
            ]:
                mid = sorted(runs, key=lambda r: r["rate"])[len(runs) // 2]
                roles = mid["cpu_ms_per_msg"]
                cpu.row(
                    kind,
                    broker,
                    ", ".join(f"{k} {v:.2f}" for k, v in roles.items()),
                    f"{sum(v for k, v in roles.items() if '.' not in k):.2f}",
                )
                if kind != "bare":
                    db = mid["db_per_msg"]
                    cpu.note(
                        f"{broker} {kind}: database per message (warm-up included): "
                        f"{db['xact_commit']:.2f} transactions, {db['tup_updated']:.2f} row updates, "
                        f"{db['tup_inserted']:.2f} inserts"
                    )

    def peer(self) -> None:
        a = self.args
        python, described = peer_python()
        if python is None:
            self.report.text(f"peer: {described}")
            self.results["peer"] = {"skipped": described}
            return
        peer = PeerRun(python, self.pipeline)
        deployments = [d.strip() for d in a.deployments.split(",") if d.strip()]
        packs = [int(p) for p in a.peer_packs.split(",") if p.strip()]
        t = self.report.table(
            f"Per message vs {described} ({a.messages} messages, {a.pool} x{a.concurrency}, "
            f"prefetch {a.prefetch}, producer and workers at the same time)",
            ["broker", "pipeline", "msg/s", "vs peer", "vs peer tuned", "vs bare Celery"],
        )
        out: dict[str, Any] = {}
        for broker, url in _brokers(a, self.svc):
            runs: dict[str, list[PipelineResult]] = {}
            for _ in range(a.repeat):
                # Alternated: every pipeline once per round.
                runs.setdefault("bare Celery", []).append(self._bare(url, a.messages))
                for label, tuned in (("peer", False), ("peer tuned", True)):
                    same = {"prefetch": a.prefetch, "producer_batch": a.producer_batch}
                    runs.setdefault(label, []).append(peer.run(url, a.messages, tuned=tuned, **same))
                for dep in deployments:
                    runs.setdefault(f"outbox-celery {dep}", []).append(
                        self._outbox(url, a.messages, single_worker=dep == "readme")
                    )
                    for pack in packs:
                        # The handler declared with pack= (DESIGN invariant 30), same deployment.
                        runs.setdefault(f"outbox-celery {dep} pack={pack}", []).append(
                            self._outbox(
                                url,
                                a.messages,
                                single_worker=dep == "readme",
                                extra_env={"BENCH_HANDLER_PACK": str(pack)},
                            )
                        )
            rates = {k: _median([r.rate for r in v]) for k, v in runs.items()}
            for key, rate in rates.items():
                t.row(
                    broker,
                    key,
                    f"{rate:,.0f}",
                    f"{rate / rates['peer']:.2f}x",
                    f"{rate / rates['peer tuned']:.2f}x",
                    f"{rate / rates['bare Celery']:.2f}x",
                )
            out[broker] = {
                "rates": rates,
                "runs": {k: [asdict(r) | {"rate": r.rate} for r in v] for k, v in runs.items()},
            }
        t.note(
            f"medians of {a.repeat} alternated rounds; the peer publishes and deletes rows (no fence, "
            "no record that a handler ran); ours records every outcome. readme: one worker -Q "
            "claim,deliver; split: a solo claim worker beside the delivery worker"
        )
        cpu = self.report.table(
            "CPU ms per message, same runs (the median run of each pipeline)",
            ["broker", "pipeline", "worker processes", "PostgreSQL", "all roles (ms/msg)"],
        )
        for broker, data in out.items():
            for key, rs in data["runs"].items():
                roles = sorted(rs, key=lambda r: r["rate"])[len(rs) // 2]["cpu_ms_per_msg"]
                # Worker processes: the Celery workers, the peer's relay and our beat (everything
                # but the producer, the broker and the database; ".main" is a part of its worker).
                workers = sum(v for k, v in roles.items() if "." not in k and k in _WORKER_ROLES)
                pg = roles.get("postgres")
                cpu.row(
                    broker,
                    key,
                    f"{workers:.2f}",
                    "-" if pg is None else f"{pg:.2f}",
                    ", ".join(f"{k} {v:.2f}" for k, v in roles.items()),
                )
        cpu.note(
            "PostgreSQL: CPU of the benchmark database's backends alive at the end of the run (a "
            "producer's backend that exited is not counted; our table is analyzed after the "
            "warm-up, as autovacuum would a table in service); bare Celery uses no database"
        )
        db = self.report.table(
            "Database cost per message, same runs (medians over the rounds; warm-up included)",
            [
                "broker",
                "pipeline",
                "commits",
                "row versions",
                "HOT updates",
                "WAL bytes",
                "PostgreSQL CPU ms",
            ],
        )
        for broker, data in out.items():
            for key, rs in data["runs"].items():
                if not rs[0].get("db_per_msg"):
                    continue  # bare Celery: no database
                per = {
                    k: _median([r["db_per_msg"][k] for r in rs])
                    for k in ("xact_commit", "row_versions", "wal_bytes", "tup_updated")
                }
                # A run recorded before the HOT count was measured has none.
                hot = _median([r["db_per_msg"].get("tup_hot_updated", float("nan")) for r in rs])
                pg_cpu = _median([r["cpu_ms_per_msg"].get("postgres", 0.0) for r in rs])
                db.row(
                    broker,
                    key,
                    f"{per['xact_commit']:.2f}",
                    f"{per['row_versions']:.2f}",
                    f"{hot:.2f} of {per['tup_updated']:.2f}",
                    f"{per['wal_bytes']:,.0f}",
                    f"{pg_cpu:.3f}",
                )
        db.note(
            "commits: pg_stat_database.xact_commit; row versions: n_tup_ins + upd + del (tup_inserted "
            "+ tup_updated + tup_deleted) of the benchmark database, from before the warm-up to after "
            "every process exited, per message; HOT updates: pg_stat_user_tables.n_tup_hot_upd of its "
            "tables, of its updates (heap-only: no new index entry); WAL bytes: pg_current_wal_lsn() "
            "difference over the same span, the whole cluster's (other databases' writes count on a "
            "shared server); "
            "PostgreSQL CPU: utime + stime from /proc/<pid>/stat of the database's backends over the "
            "measured messages (the server is local)"
        )
        self.results["peer"] = out

    def _latency_run(self, url: str, rate: float, mode: dict[str, Any], **kw: Any) -> dict[str, Any]:
        """One paced run on the README deployment; percentiles of commit -> handler start."""
        a = self.args
        r = self._outbox(url, 0, rate=rate, duration=a.latency_duration, single_worker=True, **mode, **kw)
        legs = r.extra["latency_s"]
        cut = len(legs["total"]) // 10  # the first tenth settles in
        steady = sorted(legs["total"][cut:])
        wait = sorted(legs["claim_wait"][cut:])
        hop = sorted(legs["hop"][cut:])
        return {
            "offered_rate": rate,
            "achieved_rate": r.rate,
            "messages": len(legs["total"]),
            "p50": percentile(steady, 0.5),
            "p90": percentile(steady, 0.9),
            "p99": percentile(steady, 0.99),
            "max": steady[-1],
            "claim_wait": {q: percentile(wait, q) for q in (0.5, 0.99)},
            "hop": {q: percentile(hop, q) for q in (0.5, 0.99)},
            "producer_late": r.extra.get("producer_late"),
            "idle_claim_tasks": r.extra.get("idle_claim_tasks"),
            "idle_seconds": r.extra.get("idle_seconds"),
            "cpu_ms_per_msg": r.cpu_ms_per_msg,
            "settings": r.settings,
        }

    def latency(self) -> None:
        a = self.args
        defaults = OutboxConfig()
        ms = 1000.0
        # The README deployment: one prefork worker (x concurrency) on the claim and delivery
        # queues, plus beat, library defaults; beat-only is the library without push.
        modes: list[tuple[str, dict[str, Any], bool]] = [
            ("beat only, 1 s (no push)", {"listen": False, "notify": False, "claim_interval": 1.0}, False),
            ("push (defaults)", {"claim_interval": defaults.claim_interval}, True),
            (
                "push, claim sent via broker",
                {"claim_interval": defaults.claim_interval, "variant": "push_broker"},
                False,
            ),
        ]
        out: dict[str, Any] = {}
        for broker, url in _brokers(a, self.svc):
            top = self._outbox(url, a.messages, single_worker=True).rate
            loads = sorted({float(a.latency_rate), float(max(1, round(top * a.latency_load)))})
            t = self.report.table(
                f"Latency commit -> handler start, {broker}, README deployment (one worker -Q claim,deliver, "
                f"{a.pool} x{a.concurrency}, beat; max measured there {top:,.0f} msg/s; one event per "
                f"transaction, {a.latency_duration:.0f}s per run)",
                ["mode", "load", "p50", "p90", "p99", "max", "published -> start p50/p99", "target"],
            )
            runs = []
            for label, mode, targeted in modes:
                if mode.get("variant") and broker != "redis":
                    continue  # measured once, on Redis: the design choice, not a per-broker figure
                for rate in loads:
                    res = self._latency_run(url, rate, mode) | {"mode": label, "broker": broker}
                    runs.append(res)
                    verdict = "-"
                    if targeted:
                        met = res["p50"] <= 0.015 and res["p99"] <= 0.100
                        verdict = "met" if met else "MISSED"
                    t.row(
                        label,
                        f"{rate:,.0f}/s",
                        f"{res['p50'] * ms:,.1f} ms",
                        f"{res['p90'] * ms:,.1f} ms",
                        f"{res['p99'] * ms:,.1f} ms",
                        f"{res['max'] * ms:,.0f} ms",
                        f"{res['hop'][0.5] * ms:,.1f}/{res['hop'][0.99] * ms:,.1f} ms",
                        verdict,
                    )
            t.note(
                "target (push, library defaults): p50 <= 15 ms and p99 <= 100 ms at 50/s and at half "
                "the maximum"
            )
            t.note("commit time taken by the producer right after COMMIT returns, start time by the handler")
            out[broker] = {"max_rate": top, "runs": runs}
        self.results["latency"] = out
        self._latency_extras(defaults)

    def _latency_extras(self, defaults: OutboxConfig) -> None:
        """Idle broker traffic, delayed events, and what NOTIFY costs producers."""
        a = self.args
        url = self.svc.redis_url
        ms = 1000.0
        extras: dict[str, Any] = {}
        idle = self.report.table(
            f"Idle: claim tasks through the broker in {a.latency_idle:.0f}s without load; delayed events "
            f"({a.latency_rate:.0f}/s, each with delay {a.latency_delay:g}s): handler start - "
            "available_at (Redis)",
            ["mode", "claim tasks idle", "per safety interval", "delayed p50", "delayed p99", "target"],
        )
        for label, mode, targeted in (
            ("beat only, 1 s (no push)", {"listen": False, "notify": False, "claim_interval": 1.0}, False),
            ("push (defaults)", {"claim_interval": defaults.claim_interval}, True),
        ):
            res = self._latency_run(url, a.latency_rate, mode, delay=a.latency_delay, idle=a.latency_idle)
            interval = float(mode["claim_interval"])
            per = (res["idle_claim_tasks"] or 0) / (a.latency_idle / interval)
            met = per <= 1.0 and res["p99"] <= 0.100
            idle.row(
                label,
                f"{res['idle_claim_tasks']}",
                f"{per:.2f} (interval {interval:g}s)",
                f"{res['p50'] * ms:,.1f} ms",
                f"{res['p99'] * ms:,.1f} ms",
                ("met" if met else "MISSED") if targeted else "-",
            )
            extras[label] = res
        idle.note("target (push): at most one claim task per safety interval idle; delayed p99 <= 100 ms")
        cost = self.report.table(
            f"Producer cost of NOTIFY: {a.latency_producers} processes, enqueue + commit of one event per "
            f"transaction, {a.latency_producer_seconds:g}s per run, runs interleaved",
            ["notify", "commits/s (median)", "runs", "ratio", "target >= 0.9x"],
        )
        rates: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(a.latency_producer_repeat):
            for notify in (False, True):
                rates[notify].append(
                    producer_rate(
                        self.svc.dsn,
                        notify=notify,
                        producers=a.latency_producers,
                        seconds=a.latency_producer_seconds,
                    )["rate"]
                )
        off, on = _median(rates[False]), _median(rates[True])
        ratio = on / off if off else float("nan")
        cost.row("off", f"{off:,.0f}", ", ".join(f"{r:,.0f}" for r in rates[False]), "1.00x", "")
        cost.row(
            "on",
            f"{on:,.0f}",
            ", ".join(f"{r:,.0f}" for r in rates[True]),
            f"{ratio:.2f}x",
            "met" if ratio >= 0.9 else "MISSED",
        )
        cost.note(
            "PostgreSQL serializes notifying commits (one lock from pre-commit to the commit record); "
            "the notification travels in the insert's round trip"
        )
        extras["producer_cost"] = {"off": rates[False], "on": rates[True], "ratio": ratio}
        self.results["latency_extras"] = extras

    def claim(self) -> None:
        a = self.args
        results: dict[str, ClaimCost] = {}
        for size in (a.claim_small, a.claim_large):
            table = f"bench_claim_{size}"
            built = build_table(self.svc.dsn, table, history=size, pending=a.claim_pending)
            try:
                for label, variant in (("current", ""), ("legacy", "legacy")):
                    results[f"{size}-{label}"] = measure_claim_cost(
                        self.svc.dsn,
                        history=size,
                        pending=a.claim_pending,
                        batch_size=a.batch_size,
                        batches=a.claim_batches,
                        variant=variant,
                        table=table,
                        built=built,
                    )
            finally:
                drop_table(self.svc.dsn, table)
        self.results["claim"] = {k: v.as_dict() for k, v in results.items()}
        small, large = results[f"{a.claim_small}-current"], results[f"{a.claim_large}-current"]
        old_small, old_large = results[f"{a.claim_small}-legacy"], results[f"{a.claim_large}-legacy"]
        t = self.report.table(
            f"Claim cost vs history ({a.claim_pending:,} pending; batches of {a.batch_size}; "
            f"{a.claim_batches} timed batches)",
            [
                "figure",
                f"{a.claim_large:,} history",
                f"{a.claim_small:,} history (baseline)",
                "ratio",
                "target",
            ],
        )
        ratio = large.median_ms / small.median_ms
        t.row(
            "claim transaction, median ms",
            f"{large.median_ms:.2f}",
            f"{small.median_ms:.2f}",
            f"{ratio:.2f}x",
            "met (<= 1.5x)" if ratio <= 1.5 else "MISSED (> 1.5x)",
        )
        t.row("claim transaction, p90 ms", f"{large.p90_ms:.2f}", f"{small.p90_ms:.2f}", "", "")
        slowest = a.batch_size / max(large.median_ms, small.median_ms) * 1000
        t.row(
            "rows/s (from median batch)",
            f"{a.batch_size / large.median_ms * 1000:,.0f}",
            f"{a.batch_size / small.median_ms * 1000:,.0f}",
            "",
            "met (>= 20,000)" if slowest >= 20_000 else "MISSED (< 20,000)",
        )
        t.row("rows/s (all batches, mean)", f"{large.rows_per_s:,.0f}", f"{small.rows_per_s:,.0f}", "", "")
        t.row(
            "whole claim run (lock, bound, claim, unlock), median ms",
            f"{large.run_median_ms:.2f}",
            f"{small.run_median_ms:.2f}",
            f"{large.run_median_ms / small.run_median_ms:.2f}x",
            "",
        )
        t.row(
            "legacy store (JIT left on): claim median ms",
            f"{old_large.median_ms:.2f}",
            f"{old_small.median_ms:.2f}",
            f"{old_large.median_ms / old_small.median_ms:.2f}x",
            "",
        )
        t.note(
            f"table sizes: {large.table_mb:,.0f} MiB (built in {large.fill_seconds:.0f}s) and "
            f"{small.table_mb:,.0f} MiB; 1% of the history is dead; claimed batches are marked done "
            "between timings (untimed) so in-flight stays small"
        )
        self.claim_keys(large)

    def claim_keys(self, unordered: ClaimCost | None) -> None:
        """The keys dimension and the enqueue cost, on one table with the large history."""
        a = self.args
        table = "bench_claim_keys"
        cases: list[tuple[str, int, int, int]] = []
        for k in (int(x) for x in a.claim_keys.split(",") if x.strip()):
            cases.append((f"{k:,} keys", k, max(a.claim_ordered, k), 0))
        if a.claim_in_flight:
            busy, keys = (int(x) for x in a.claim_in_flight.split("/"))
            cases.append((f"{keys:,} keys, {busy:,} heads in flight", keys, a.claim_ordered, busy))
        history_seconds, history_mb = build_history(self.svc.dsn, table, history=a.claim_large)
        results: list[KeysCost] = []
        try:
            for label, keys, rows, busy in cases:
                results.append(
                    measure_keys(
                        self.svc.dsn,
                        table,
                        label=label,
                        keys=keys,
                        rows=rows,
                        in_flight=busy,
                        batch_size=a.batch_size,
                        batches=a.claim_batches,
                        before_batches=a.claim_before_batches,
                    )
                )
            enq = measure_enqueue(self.svc.dsn, table, n=a.enqueue_n)
        finally:
            drop_table(self.svc.dsn, table)
        self.results["claim_keys"] = [r.as_dict() for r in results]
        self.results["enqueue"] = enq.as_dict()
        base = unordered.median_ms if unordered else float("nan")
        t = self.report.table(
            f"Ordered claim vs number of keys ({a.claim_large:,} rows of history; batches of {a.batch_size}; "
            f"{a.claim_batches} timed claims per case)",
            [
                "case",
                "unfinished ordered rows",
                "rows/claim",
                "claim median ms",
                "p90 ms",
                "unordered claim median ms (baseline)",
                "skip-scan claim median ms",
                "heads statement: ms, buffers",
                "skip-scan claim: ms, buffers",
                "target",
            ],
        )
        for r in results:
            t.row(
                r.label,
                f"{r.rows:,}",
                f"{r.rows_per_claim:.0f}",
                f"{r.median_ms:.2f}",
                f"{r.p90_ms:.2f}",
                f"{base:.2f}",
                f"{r.before_median_ms:.1f}" if r.before_ms else "-",
                f"{r.heads_plan[0]:.2f}, {r.heads_plan[1]:,}",
                f"{r.before_plan[0]:.1f}, {r.before_plan[1]:,}" if r.before_ms else "-",
                "met (<= 10 ms)" if r.median_ms <= 10 else "MISSED (> 10 ms)",
            )
        t.note(
            "in-flight keys hold only their head (processing, live lease); the other keys share the "
            "rest, ids interleaved. Claimed heads go done and hand their key on between timings "
            f"(untimed). 'skip-scan claim': a recursive skip scan of the same rows, {a.claim_before_batches} "
            "timed claims. 'heads statement': the ordered claim statement alone, half a batch, "
            "EXPLAIN (ANALYZE, BUFFERS), rolled back: server time and shared buffers touched, "
            "which the machine's load does not change. With 10 keys a claim can return 10 rows only. "
            f"History built in "
            f"{history_seconds:.0f}s ({history_mb:,.0f} MiB); each case loaded in "
            + ", ".join(f"{r.load_seconds:.0f}s" for r in results)
        )
        t = self.report.table(
            f"Enqueue cost, ordered beside unordered ({a.enqueue_n} transactions per kind, interleaved, "
            f"on the table above: {a.claim_large:,} rows of history, last keys case loaded)",
            [
                "kind",
                "enqueue call median us",
                "transaction median us",
                "ratio to unordered (call)",
                "target",
            ],
        )
        u = enq.median("statement", "unordered")
        ub = enq.median("statement", "batch of 100 unordered")
        for kind in ENQUEUE_KINDS:
            ref = ub if kind.startswith("batch") else u
            ratio = enq.median("statement", kind) / ref
            target = ""
            if "ordered" in kind and "unordered" not in kind and "before" not in kind:
                target = "met (<= 1.5x)" if ratio <= 1.5 else "MISSED (> 1.5x)"
            t.row(
                kind,
                f"{enq.median('statement', kind):,.0f}",
                f"{enq.median('transaction', kind):,.0f}",
                f"{ratio:.2f}x",
                target,
            )
        t.note("enqueue call: key lock (ordered) + insert; transaction: BEGIN to COMMIT, durable commit")

    # -- horizon ---------------------------------------------------------------------------

    def _stock_server(self) -> tuple[StockServer, str]:
        """The horizon sections' server (stock settings) and a throw-away database on it."""
        if self._stock is None:
            server = self.stack.enter_context(stock_server(self.args.dsn, self.workdir))
            dsn = (
                self.svc.dsn
                if self.args.dsn
                else self.stack.enter_context(temporary_database(server.dsn, prefix="outbox_bench"))
            )
            self.report.text(f"horizon server: {server.describe()}")
            if server.autovacuum != "on":
                self.report.text(
                    "WARNING: autovacuum is off on this server: not the stock settings this benchmark needs"
                )
            self.results["horizon_server"] = asdict(server) | {"dsn": redact(server.dsn)}
            self._stock = (server, dsn)
        return self._stock

    def horizon(self) -> None:
        """Both horizon measurements: end to end under a pin, then claim cost vs dead versions."""
        self.horizon_load()
        self.horizon_claim()

    def horizon_load(self) -> None:
        """The README deployment at a steady rate, a snapshot pinned for a while, per window."""
        a = self.args
        server, dsn = self._stock_server()
        defaults = OutboxConfig()
        pipeline = Pipeline(dsn, self.workdir, concurrency=a.concurrency, pool=a.pool, timeout=900.0)
        pins = [float(x) for x in a.pin_seconds.split(",") if x.strip()]
        variants = [v.strip() for v in a.horizon_variants.split(";") if v.strip()]
        churned = f" + {a.horizon_churn:,} dead versions churned in at its start" if a.horizon_churn else ""
        if a.horizon_readers:
            churned += f" + {a.horizon_readers} REPEATABLE READ readers scanning the table every 0.1 s"
        plan = [(f"pin {p:g} s{churned}", p, True, 0, "") for p in pins]
        # Each variant's run right after the current code's: the same server, the same run.
        plan = [
            run
            for (label, p, pinned, purge, _) in plan
            for run in [(label, p, pinned, purge, "")]
            + [(f"{label} [{v}]", p, pinned, purge, v) for v in variants]
        ]
        if a.horizon_baseline:
            plan.insert(0, ("no pin (baseline)", pins[0] if pins else 60.0, False, 0, ""))
        if a.horizon_purge:
            # Retention under load: a week of done rows deleted by the purge while messages flow.
            plan.append(
                (
                    f"purge {a.horizon_purge:,} done rows",
                    pins[0] if pins else 60.0,
                    False,
                    a.horizon_purge,
                    "",
                )
            )
        ms = 1000.0
        out = []
        for label, pin, pinned, purge_rows, variant in plan:
            sc = run_scenario(
                pipeline,
                self.svc.redis_url,
                label=label,
                rate=a.horizon_rate,
                warmup=a.horizon_warmup,
                pin=pin,
                tail=a.horizon_tail,
                pinned=pinned,
                window=a.horizon_window,
                claim_interval=defaults.claim_interval,
                batch_size=defaults.batch_size,
                purge_rows=purge_rows,
                churn=a.horizon_churn,
                variant=variant,
                readers=a.horizon_readers,
            )
            out.append(sc)
            t = self.report.table(
                f"Horizon: {label}, {a.horizon_rate:g} events/s (one per transaction), README deployment "
                f"(one worker -Q claim,deliver, {a.pool} x{a.concurrency}, beat, push, library defaults), "
                f"Redis; {server.describe()}; pin from t={a.horizon_warmup:g}s for {pin:g}s"
                + (
                    ""
                    if pinned
                    else " (marked only: nothing pinned)"
                    if not purge_rows
                    else " (no pin: a purge)"
                ),
                [
                    "t (s)",
                    "pin",
                    "committed",
                    "started",
                    "p50 ms",
                    "p99 ms",
                    "unfinished max",
                    "dead tuples",
                    "autovacuums",
                    "count ms",
                ],
            )
            for w in sc.windows:
                t.row(
                    f"{w['t']:.0f}",
                    ("held" if w["pin_held"] else "span") if w["pinned"] else "",
                    str(w["committed"]),
                    str(w["started"]),
                    "-" if w["p50"] is None else f"{w['p50'] * ms:,.1f}",
                    "-" if w["p99"] is None else f"{w['p99'] * ms:,.1f}",
                    "-" if w["unfinished_max"] is None else f"{w['unfinished_max']:,}",
                    "-" if w["dead"] is None else f"{w['dead']:,}",
                    "-" if w["autovacuums"] is None else str(w["autovacuums"]),
                    "-" if w["count_ms_max"] is None else f"{w['count_ms_max']:,.1f}",
                )
            t.note(
                "windows by commit time; started: handler starts in the window; unfinished: pending + "
                "processing, sampled every second (max); dead tuples: pg_stat_user_tables.n_dead_tup at "
                "the window's last sample; count ms: that sample's count of unfinished rows (it walks the "
                "claim's partial indexes)"
            )
            if sc.pin:
                t.note(f"pin: {sc.pin}")
            if sc.monitor_error:
                t.note(f"sampler FAILED: {sc.monitor_error}")
            if sc.producer_late:
                t.note(f"producer late (>10 ms behind its schedule) for {sc.producer_late} events")
            t.note(
                f"1-min load average {sc.load[0]:.2f} at the start, {sc.load[1]:.2f} at the end "
                f"({os.cpu_count()} CPUs; a load that was high before the run started is other work)"
            )
        summary = self.report.table(
            f"Horizon summary ({a.horizon_rate:g} events/s; goals: p99 in every pinned window <= 250 ms and "
            f"<= 3x the p99 before the pin; unfinished <= {a.horizon_rate:g} rows, one second of production)",
            [
                "scenario",
                "p99 before pin",
                "worst pinned p99",
                "ratio",
                "max unfinished",
                "max dead tuples",
                "back within 3x after",
                "p99 goal",
                "unfinished goal",
            ],
        )
        for sc in out:
            m = sc.summary
            rec = m["recovered_s"]
            summary.row(
                sc.label,
                f"{m['p99_before'] * ms:,.1f} ms",
                f"{m['p99_worst_pinned'] * ms:,.1f} ms",
                f"{m['ratio']:.1f}x",
                f"{m['unfinished_max']:,}",
                f"{m['dead_max']:,}",
                "never" if rec is None else f"{rec:.0f} s",
                "met" if m["p99_goal_met"] else "MISSED",
                "met" if m["unfinished_goal_met"] else "MISSED",
            )
        summary.note(
            "the baseline's 'pinned' windows are the same span with nothing pinned; before the pin: "
            f"commits from t={a.horizon_window:g}s (the first window settles in) to the pin"
        )
        self.results["horizon"] = {"server": server.describe(), "scenarios": [s.as_dict() for s in out]}

    def horizon_claim(self) -> None:
        """One claim of 200 rows with 0, 100k, 500k dead versions (made under a pin) in front of it.

        Twice: with the claim loop's scan marks (invariant 18) and with every scan from the index
        start (the claim scanning every lease from the start), each on a table of its own, in one run.
        """
        a = self.args
        server, dsn = self._stock_server()
        levels = [int(x) for x in a.horizon_dead.split(",") if x.strip()]
        runs = {
            variant: measure_claim_vs_dead(
                dsn,
                levels=levels,
                claims=a.horizon_claims,
                limit=a.batch_size,
                churn_batch=a.horizon_churn_batch,
                marks=variant == "marks",
            )
            for variant in ("marks", "from the start")
        }
        marks, start = runs["marks"], runs["from the start"]
        base = marks[0].median_ms
        t = self.report.table(
            f"Claim cost vs dead versions (one Store and connection reused, as the claim loop does; "
            f"claims of {a.batch_size} rows, median of {a.horizon_claims}; {server.describe()})",
            [
                "dead versions",
                "n_dead_tup",
                "marks: median ms",
                "max",
                "from the start: median ms",
                "max",
                "marks vs 0 dead",
                "goal (<= 10 ms, flat)",
                "stats ms",
            ],
        )
        for m, f in zip(marks, start, strict=True):
            t.row(
                m.label,
                f"{m.n_dead_tup:,}",
                f"{m.median_ms:,.2f}",
                f"{max(m.claim_ms):,.2f}",
                f"{f.median_ms:,.2f}",
                f"{max(f.claim_ms):,.2f}",
                f"{m.median_ms / base:.1f}x",
                "met" if m.median_ms <= 10 else "MISSED",
                f"{m.stats_ms:,.0f}",
            )
        t.note(
            "dead versions made by churn under a REPEATABLE READ snapshot held meanwhile: rows inserted, "
            f"claimed ({a.horizon_churn_batch:,} a claim), started and done (3 per row; the timed claims' "
            "own rows count too); churn took "
            + ", ".join(f"{r.churn_seconds:.0f}s" for r in marks + start if r.churn_seconds)
            + ". With marks the timed claims wait one scan_lookback (10 s) first; a full pass "
            "(every 60 s) is the max column when one fell among them. stats ms: one admin.stats "
            "(outbox-celery stats, a Prometheus scrape) on the marks' table at that level."
        )
        self.results["horizon_claim"] = {
            "server": server.describe(),
            "variants": {k: [r.as_dict() for r in v] for k, v in runs.items()},
        }

    def ordered(self) -> None:
        """End to end: keys x 2 ordered events beside as many unordered ones, on Redis."""
        a = self.args
        n = 2 * a.ordered_keys
        url = self.svc.redis_url
        runs: dict[str, list[PipelineResult]] = {"unordered": [], "ordered": []}
        for _ in range(a.repeat):
            runs["unordered"].append(self._outbox(url, n))
            runs["ordered"].append(self._outbox(url, n, ordered_keys=a.ordered_keys))
        u = _median([r.rate for r in runs["unordered"]])
        o = _median([r.rate for r in runs["ordered"]])
        inversions = sum(int(r.extra.get("inversions") or 0) for r in runs["ordered"])
        self.results["ordered"] = {k: [asdict(r) | {"rate": r.rate} for r in v] for k, v in runs.items()} | {
            "ratio": o / u,
            "inversions": inversions,
        }
        t = self.report.table(
            f"Ordered drain end to end ({a.ordered_keys:,} keys x 2 events = {n:,} messages; Redis; "
            f"{a.pool} x{a.concurrency}; {a.repeat} run(s) each, interleaved, medians)",
            ["figure", "ordered", "unordered (baseline)", "ratio", "target"],
        )
        t.row(
            "messages/s",
            f"{o:,.0f}",
            f"{u:,.0f}",
            f"{o / u:.2f}x",
            "met (>= 0.9x)" if o / u >= 0.9 else "MISSED (< 0.9x)",
        )
        t.row(
            "inversions (same key, done out of id order)",
            str(inversions),
            "-",
            "",
            "met (0)" if not inversions else "MISSED",
        )

    def wins(self) -> None:
        a = self.args
        url = self.svc.redis_url
        plan: list[tuple[str, Callable[[], PipelineResult]]] = [
            ("outbox", lambda: self._outbox(url, a.messages)),
            ("outbox, legacy store", lambda: self._outbox(url, a.messages, variant="legacy")),
            ("outbox, prefetch 4", lambda: self._outbox(url, a.messages, prefetch=4)),
            ("outbox, acks early", lambda: self._outbox(url, a.messages, variant="acks_early")),
            ("bare", lambda: self._bare(url, a.messages)),
            ("bare, prefetch 4", lambda: self._bare(url, a.messages, prefetch=4)),
        ]
        runs: dict[str, list[PipelineResult]] = {name: [] for name, _ in plan}
        for _ in range(a.repeat):
            for name, run in plan:
                runs[name].append(run())
        med = {k: _median([r.rate for r in v]) for k, v in runs.items()}
        self.results["wins"] = {k: [asdict(r) | {"rate": r.rate} for r in v] for k, v in runs.items()}
        t = self.report.table(
            f"Measured wins, end to end on Redis ({a.messages} messages, prefetch {a.prefetch} unless said, "
            f"medians of {a.repeat})",
            ["change", "msg/s", "baseline", "baseline msg/s", "ratio"],
        )
        for name, base in (
            ("outbox", "outbox, legacy store"),
            ("outbox, prefetch 4", "outbox"),
            ("outbox, acks early", "outbox"),
            ("bare, prefetch 4", "bare"),
            ("outbox", "bare"),
            ("outbox, prefetch 4", "bare, prefetch 4"),
        ):
            t.row(name, f"{med[name]:,.0f}", base, f"{med[base]:,.0f}", f"{med[name] / med[base]:.2f}x")
        for name, v in runs.items():
            cpu = sorted(v, key=lambda r: r.rate)[len(v) // 2].cpu_ms_per_msg
            t.note(f"{name}: CPU ms/msg " + ", ".join(f"{k} {x:.2f}" for k, x in cpu.items()))

    def profile(self) -> None:
        a = self.args
        profiler = Profiler(RESULTS)
        if not profiler.available:
            self.report.text("profile: py-spy is not installed (pip install py-spy); skipped")
            return
        # The first deployment of --deployments (readme: the worker's main process claims too).
        readme = [d.strip() for d in a.deployments.split(",") if d.strip()][:1] == ["readme"]
        env = {"BENCH_HANDLER_PACK": str(a.profile_pack)} if a.profile_pack else None
        r = self._outbox(
            self.svc.redis_url, a.messages, attach=profiler.attach, single_worker=readme, extra_env=env
        )
        summaries = profiler.stop()
        self.results["profile"] = {"rate_under_profiler": r.rate, "roles": [s.as_dict() for s in summaries]}
        for s in summaries:
            t = self.report.table(
                f"Profile: {s.role} ({s.busy_samples} busy samples, {s.idle_samples} idle left out): "
                "where the busy time goes",
                ["share", "bucket (by the sampled frame itself)"],
            )
            for name, pct in s.buckets:
                t.row(f"{pct:5.1f}%", name)
            t2 = self.report.table(f"Profile: {s.role}, top functions", ["self", "function"])
            for f, pct in s.self_top[:12]:
                t2.row(f"{pct:5.1f}%", f)
            t3 = self.report.table(
                f"Profile: {s.role}, inclusive (event-loop frames above 90% left out)",
                ["incl", "function (and below)"],
            )
            for f, pct in [x for x in s.inclusive_top if x[1] < 90][:15]:
                t3.row(f"{pct:5.1f}%", f)
        self.report.text(
            f"py-spy raw stacks: {RESULTS}/profile-*.raw.txt (rate under the profiler {r.rate:,.0f} msg/s)"
        )

    def soak(self) -> None:
        a = self.args
        n = a.soak or 100_000
        r = self._outbox(self.svc.redis_url, n, sample_rss=True)
        samples = r.rss["samples"]
        base = next(s for s in samples if s[0] >= n // 10)
        end = samples[-1]
        growth_d = (end[1] - base[1]) / base[1]
        growth_c = (end[2] - base[2]) / base[2]
        self.results["soak"] = {
            "n": n,
            "rate": r.rate,
            "samples": samples,
            "growth_deliver": growth_d,
            "growth_claim": growth_c,
        }
        t = self.report.table(
            f"Memory over {n:,} messages end to end (Redis, {r.rate:,.0f} msg/s)",
            [
                "process",
                f"RSS at {base[0]:,} done (baseline)",
                f"RSS at {end[0]:,} done",
                "growth",
                "target < 10%",
            ],
        )
        t.row(
            "delivery worker (main + pool)",
            f"{base[1] / 2**20:.1f} MiB",
            f"{end[1] / 2**20:.1f} MiB",
            f"{growth_d:+.1%}",
            "met" if growth_d < 0.1 else "MISSED",
        )
        t.row(
            "claim worker",
            f"{base[2] / 2**20:.1f} MiB",
            f"{end[2] / 2**20:.1f} MiB",
            f"{growth_c:+.1%}",
            "met" if growth_c < 0.1 else "MISSED",
        )


def _apply_quick(args: argparse.Namespace) -> None:
    args.messages = min(args.messages, 1000)
    args.repeat = 1
    args.plain_messages = min(args.plain_messages, 1000)
    args.latency_duration = min(args.latency_duration, 5.0)
    args.latency_idle = min(args.latency_idle, 10.0)
    args.latency_producer_seconds = min(args.latency_producer_seconds, 2.0)
    args.latency_producer_repeat = 1
    args.warmup = min(args.warmup, 500)
    args.claim_small = min(args.claim_small, 2000)
    args.claim_large = min(args.claim_large, 20_000)
    args.claim_pending = min(args.claim_pending, 20_000)
    args.claim_batches = min(args.claim_batches, 10)
    args.claim_keys = "10,1000,5000"
    args.claim_ordered = min(args.claim_ordered, 10_000)
    args.claim_in_flight = "4900/5000"
    args.enqueue_n = min(args.enqueue_n, 100)
    args.horizon_warmup = min(args.horizon_warmup, 20.0)
    args.horizon_tail = min(args.horizon_tail, 20.0)
    args.pin_seconds = "20"
    args.horizon_dead = "20000,60000"
    args.horizon_claims = min(args.horizon_claims, 5)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the chosen sections, print the tables, write the JSON."""
    args = _parser().parse_args(argv)
    if args.quick:
        _apply_quick(args)
    chosen = _sections(args)
    report = Report(sys.stdout)
    started = time.monotonic()
    RESULTS.mkdir(exist_ok=True)
    meta: dict[str, Any] = {
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "sections": chosen,
    }
    with (
        tempfile.TemporaryDirectory(prefix="outbox-bench-") as tmp,
        services(
            Path(tmp),
            dsn=args.dsn,
            redis_url=args.redis_url,
            amqp_url=args.amqp_url,
            want_amqp="rabbitmq" in args.brokers or "amqp" in args.brokers,
        ) as svc,
    ):
        with psycopg.connect(svc.dsn) as conn:
            version = conn.execute("SHOW server_version").fetchone()
        meta["services"] = svc.describe()
        meta["postgresql_version"] = version[0] if version else "?"
        report.text(
            "outbox-celery benchmarks  "
            + "  ".join(f"{k}: {v}" for k, v in meta["services"].items())
            + f"\nPostgreSQL {meta['postgresql_version']}, {os.cpu_count()} CPUs, load average "
            + " ".join(f"{x:.2f}" for x in os.getloadavg())
            + f", sections: {', '.join(chosen)}"
        )
        if any(c.startswith("horizon") or c == "databases" for c in chosen) and not args.dsn:
            report.text(
                "horizon and databases sections: on a private PostgreSQL with stock settings they start "
                "themselves (the server above may run with autovacuum off)"
            )
        bench = Bench(args, svc, Path(tmp), report)
        steps: dict[str, Callable[[], None]] = {
            "plain": bench.plain,
            "e2e": bench.e2e,
            "latency": bench.latency,
            "claim": bench.claim,
            "wins": bench.wins,
            "profile": bench.profile,
            "soak": bench.soak,
            "ordered": bench.ordered,
            "horizon": bench.horizon,
            "horizon-load": bench.horizon_load,
            "horizon-claim": bench.horizon_claim,
            "transactional": bench.transactional,
            "peer": bench.peer,
            "batch": bench.batch,
            "flow": bench.flow,
            "flow-bounds": bench.flow_bounds,
            "subscriptions": bench.subscriptions,
            "groups": bench.groups,
            "databases": bench.databases,
        }
        failures = 0
        try:
            for name in chosen:
                t0, began = time.monotonic(), time.time()
                try:
                    steps[name]()
                except Exception as exc:  # report and go on: one broken section must not hide the rest
                    failures += 1
                    report.text(f"section {name} FAILED: {type(exc).__name__}: {exc}")
                    bench.results[name] = {"error": f"{type(exc).__name__}: {exc}"}
                    kept = _keep_logs(Path(tmp), name, began)
                    if kept is not None:
                        report.text(f"its processes' logs: {kept}")
                meta.setdefault("section_seconds", {})[name] = round(time.monotonic() - t0, 1)
        finally:
            bench.close()
    meta["seconds"] = round(time.monotonic() - started, 1)
    meta["load_after"] = os.getloadavg()
    out = args.json or RESULTS / f"bench-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"meta": meta, "results": bench.results}, indent=2, default=str))
    report.flush()
    report.text(
        f"total {meta['seconds']:.0f}s; load average now {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    report.text(f"results: {out}")
    return 1 if failures else 0


def _terminate(signum: int, frame: Any) -> None:
    # SIGTERM unwinds like Ctrl-C, so every started process group is stopped on the way out.
    raise KeyboardInterrupt


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminate)
    sys.exit(main())
