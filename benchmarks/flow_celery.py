"""Flow control with real Celery workers: do the limits hold across a fleet, what do they cost?

``python -m benchmarks.flow_celery`` (options: ``--help``; also ``make bench BENCH_ARGS="--only
flow"``) runs the end-to-end harness of ``benchmarks/pipeline.py`` (a producer process, a solo
claim worker whose push listener claims, beat, and ``--workers`` (3) delivery workers of
``--processes`` (4) prefork processes each, Redis as the broker) and prints, each figure beside
the same run without limits:

* **concurrency**: ``--messages`` (2,000) of a type limited to ``--concurrency`` (5) whose
  handler sleeps ``--sleep`` (50 ms): the most handlers running at once, from every handler's
  start and end (``time.time()``, the machine's one clock, written per process to a file), and
  the throughput beside ``concurrency / sleep``; with the freed-slot wake (the library) and
  without it (the ``no_slot_wake`` benchmark variant: the finish goes through the done batcher
  and the claim finds the slot at its next ``LIMIT_RECHECK``), and without limits;
* **rate**: a type limited to ``--rate`` (50/s) with ``rate x (--rate-seconds + 1)`` queued,
  no-op handler: the most handler starts in any 1-s window (sliding, and aligned on the first
  start) beside the rate plus one burst (the tolerance, ``max(1, rate x 0.2 s)``), and the
  starts in the first ``--rate-seconds`` (default 20 for a quick run; the issue's figure is 60)
  beside ``rate x T`` (5 % band); beside the same backlog without limits;
* **cost**: end-to-end throughput of ``--cost-messages`` (5,000) no-op messages with limits
  declared but not binding (``concurrency=1000, rate="100000/s"``), with and without the
  freed-slot wake, beside no limits, alternated for ``--cost-rounds`` (3) rounds, medians.

Handler starts follow the claims after a hop through the broker: their 1-s windows can bunch by
that hop's jitter (the bound is on the claims). Short runs on a shared development machine; the
figures in docs/performance.md say where they come from.
"""

from __future__ import annotations

import argparse
import bisect
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from outbox_celery.flow import Limit, parse_rate

from .pipeline import Pipeline, PipelineResult
from .services import services

__all__ = ["FlowRun", "main", "max_overlap", "most_in_window"]

PARTS = ("concurrency", "rate", "cost")


@dataclass
class FlowRun:
    """One end-to-end run: the harness's result and the measured messages' handler spans."""

    result: PipelineResult
    spans: list[tuple[float, float]]  # (start, end), time.time(), sorted by start

    @property
    def handler_rate(self) -> float:
        """Handlers finished per second, first start to last end."""
        first, last = self.spans[0][0], max(e for _, e in self.spans)
        return len(self.spans) / (last - first) if last > first else 0.0


def max_overlap(spans: Sequence[tuple[float, float]]) -> int:
    """The most spans open at one instant (an end at the same time as a start closes first)."""
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    now = most = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def most_in_window(starts: Sequence[float], seconds: float = 1.0) -> tuple[int, int]:
    """The most starts in any ``seconds`` window (sliding), and in windows aligned on the first."""
    ordered = sorted(starts)
    sliding = max((bisect.bisect_left(ordered, s + seconds) - i for i, s in enumerate(ordered)), default=0)
    aligned: dict[int, int] = {}
    for s in ordered:
        k = int((s - ordered[0]) // seconds)
        aligned[k] = aligned.get(k, 0) + 1
    return sliding, max(aligned.values(), default=0)


def _spans(folder: Path, n: int) -> list[tuple[float, float]]:
    """The spans of the last ``n`` ids (the measured messages; the warm-up's come first)."""
    rows: dict[int, tuple[float, float]] = {}
    for path in folder.glob("spans-*.txt"):
        for line in path.read_text().splitlines():
            i, s, e = line.split()
            rows.setdefault(int(i), (float(s), float(e)))  # a redelivery: its first run
    measured = [rows[i] for i in sorted(rows)[-n:]]
    return sorted(measured)


class FlowBench:
    """Runs the flow parts on one PostgreSQL database and one Redis broker."""

    def __init__(self, args: argparse.Namespace, dsn: str, redis_url: str, workdir: Path) -> None:
        self.a = args
        self.redis_url = redis_url
        self.workdir = workdir
        self.pipe = Pipeline(dsn, workdir, concurrency=args.processes, pool="prefork")

    def run(
        self,
        n: int,
        *,
        concurrency: int | None = None,
        rate: str | None = None,
        sleep: float = 0.0,
        variant: str = "",
        warmup: int = 20,
        tag: str = "flow",
    ) -> FlowRun:
        spans = self.workdir / f"spans-{uuid.uuid4().hex[:6]}"
        spans.mkdir()
        env = {"BENCH_SPANS_DIR": str(spans), "BENCH_HANDLER_SLEEP": str(sleep)}
        if concurrency is not None:
            env["BENCH_LIMIT_CONCURRENCY"] = str(concurrency)
        if rate is not None:
            env["BENCH_LIMIT_RATE"] = rate
        result = self.pipe.outbox(
            self.redis_url,
            n,
            warmup=warmup,
            variant=variant,
            tag=tag,
            delivery_workers=self.a.workers,
            extra_env=env,
        )
        return FlowRun(result, _spans(spans, n))

    def concurrency(self) -> None:
        a = self.a
        n, limit, sleep = a.messages, a.concurrency, a.sleep
        print(
            f"\nconcurrency: {n} messages, handler {sleep * 1000:.0f} ms, {a.workers} workers x prefork "
            f"{a.processes} + a claim worker; limit {limit}: at most {limit} at once, "
            f"{limit} / {sleep * 1000:.0f} ms = {limit / sleep:.0f}/s"
        )
        runs = {
            f"limit {limit} (a freed slot wakes the claim)": dict(concurrency=limit),
            f"limit {limit}, no wake (no_slot_wake, before)": dict(concurrency=limit, variant="no_slot_wake"),
            "no limits": {},
        }
        for label, kw in runs.items():
            run = self.run(n, sleep=sleep, tag="conc", **kw)
            print(
                f"  {label:<48} most at once {max_overlap(run.spans):>3}   handlers {run.handler_rate:6.1f}/s"
                f"   end to end {run.result.rate:6.1f}/s"
            )

    def rate(self) -> None:
        a = self.a
        per_second = parse_rate(a.rate)
        burst = Limit(rate=per_second).burst
        seconds = a.rate_seconds
        n = int(per_second * (seconds + 1))
        expected = per_second * seconds
        print(
            f"\nrate: {n} no-op messages queued, limit {a.rate}; tolerance one burst max(1, rate x 0.2 s) "
            f"= {burst:g}: at most {per_second + burst:g} starts in any 1-s window; the first "
            f"{seconds:g} s within 5% of {expected:g}"
        )
        for label, kw in {f"limit {a.rate}": dict(rate=a.rate), "no limits": {}}.items():
            run = self.run(n, tag="rate", **kw)
            starts = [s for s, _ in run.spans]
            sliding, aligned = most_in_window(starts)
            first = starts[0]
            in_t = sum(1 for s in starts if s < first + seconds)
            span = starts[-1] - first
            print(
                f"  {label:<12} most starts in a 1-s window {sliding:>5} sliding, {aligned:>5} aligned;"
                f" first {seconds:g} s: {in_t} ({(in_t / expected - 1) * 100:+.1f}% of {expected:g});"
                f" all {n} over {span:.1f} s"
            )

    def cost(self) -> None:
        a = self.a
        n = a.cost_messages
        variants: dict[str, dict[str, Any]] = {
            "no limits": {},
            'limits not binding (concurrency=1000, rate="100000/s")': dict(concurrency=1000, rate="100000/s"),
            "the same, no wake (no_slot_wake: dones batched)": dict(
                concurrency=1000, rate="100000/s", variant="no_slot_wake"
            ),
        }
        rates: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(a.cost_rounds):
            for label, kw in variants.items():
                run = self.run(n, warmup=1000, tag="cost", **kw)
                rates[label].append(run.result.rate)
        print(
            f"\ncost: {n} no-op messages end to end, {a.workers} workers x prefork {a.processes}, "
            f"alternated, median of {a.cost_rounds} rounds"
        )
        base = statistics.median(rates["no limits"])
        for label, values in rates.items():
            med = statistics.median(values)
            rounds = ", ".join(f"{v:.0f}" for v in values)
            print(f"  {label:<56} {med:7.1f}/s ({(med / base - 1) * 100:+.1f}%)  rounds: {rounds}")


def parser() -> argparse.ArgumentParser:
    """The options (also parsed for ``make bench``'s ``--only flow`` section)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.flow_celery", description=__doc__.splitlines()[0])
    add_arguments(p)
    p.add_argument("--dsn", help="a PostgreSQL server's maintenance database (default: local, else embedded)")
    p.add_argument(
        "--redis-url", help="Redis broker (default: 127.0.0.1:6379/15 if reachable, else embedded)"
    )
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated among {', '.join(PARTS)}")
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flow options, shared with ``python -m benchmarks`` (prefixed there)."""
    p.add_argument("--workers", type=int, default=3, help="delivery workers (default 3)")
    p.add_argument("--processes", type=int, default=4, help="prefork processes per worker (default 4)")
    p.add_argument("--messages", type=int, default=2000, help="concurrency part (default 2000)")
    p.add_argument("--concurrency", type=int, default=5)
    p.add_argument("--sleep", type=float, default=0.05, help="handler seconds, concurrency part")
    p.add_argument("--rate", default="50/s")
    p.add_argument(
        "--rate-seconds", type=float, default=20.0, help="rate part's window (default 20; the issue's is 60)"
    )
    p.add_argument("--cost-messages", type=int, default=5000)
    p.add_argument("--cost-rounds", type=int, default=3)


def run_parts(
    args: argparse.Namespace, dsn: str, redis_url: str, workdir: Path, parts: Sequence[str]
) -> None:
    """Run the chosen parts and print their figures."""
    bench = FlowBench(args, dsn, redis_url, workdir)
    for part in parts:
        getattr(bench, part)()


def main(argv: Sequence[str] | None = None) -> int:
    a = parser().parse_args(argv)
    parts = [s.strip() for s in a.parts.split(",") if s.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown parts {sorted(unknown)}; choose among {', '.join(PARTS)}")
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="outbox-flow-") as tmp,
        services(Path(tmp), dsn=a.dsn, redis_url=a.redis_url, amqp_url=None, want_amqp=False) as svc,
    ):
        info = svc.describe()
        print(
            f"postgresql: {info['postgresql']}  redis: {info['redis']}\n"
            f"{os.cpu_count()} CPUs (shared with other users: figures vary), load average "
            + " ".join(f"{x:.2f}" for x in os.getloadavg())
        )
        run_parts(a, svc.dsn, svc.redis_url, Path(tmp), parts)
    print(
        f"\ntotal {time.monotonic() - started:.0f} s; load average now "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
