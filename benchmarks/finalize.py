"""The one-message path's fenced writes: this tree's completer beside a baseline release's store.

``python -m benchmarks.finalize --baseline <git ref> [--dsn DSN] [--rows N] [--rounds R] [--stale-stats]``

Times ``--rows`` one-row deliveries' database writes on one autocommit connection (the worker's)
through :class:`~outbox_celery.db.store.Store`'s completer: the fenced start, then the
finalize as the one-message handler writes it (the completer's finish of a done of an unordered
row, or of a retry). The package as it is at ``--baseline`` (extracted with ``git archive``) and
the working tree's run in turn, ``--rounds`` times each, alternated, each run in a fresh process
and a fresh database on the same server; the medians of the rounds are printed side by side, in
microseconds per delivery (start + finalize): wall time, the client process's CPU time and,
when the server runs on this host, its backend's CPU time (``/proc``), which a shared, busy
machine disturbs far less than the wall time.

Then ``--rows`` claim runs of one row each (``claim run``: the claimer's whole run, as a push
listener runs it per notification at a low rate: the claim lock, the in-flight count, the claim
and its commit, a no-op publish), each row inserted before and delivered after the run on
another connection, outside the figures.

Every delivery's lease is claimed before the first start, so ``--rows`` leases are live while
they run. With ``--stale-stats`` the table is analyzed after its rows are written and before
they are claimed: the statistics then say that no lease is live (a table analyzed between two
bursts), the case where a fenced statement free to read the live leases' partial index instead
of the primary key steps over every live lease to find its own row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LEASE, MAX_ATTEMPTS = 300.0, 5
OUTCOMES = ("done", "retry")


def _backend_cpu(pid: int) -> float | None:
    """Seconds of CPU the server backend ``pid`` has used (``/proc``: a server on this host)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child(dsn: str, rows: int, *, stale_stats: bool = False) -> dict[str, float]:
    """One run (in the process whose ``outbox_celery`` is measured): microseconds per delivery,
    of wall time (``<outcome>``), of this process's CPU (``<outcome> client cpu``) and of the
    server backend's CPU (``<outcome> server cpu``, when the server runs on this host)."""
    import psycopg

    from outbox_celery import migrate
    from outbox_celery.claim import executor
    from outbox_celery.db.store import Store, starter_token
    from outbox_celery.testing import temporary_database

    from .plain import _noop, fill_pending

    def claim(conn: psycopg.Connection[Any], store: Store, n: int) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        while len(out) < n:
            got = executor.claim(
                store, conn, limit=min(1000, n - len(out)), lease=LEASE, owner="bench", max_attempts=50
            )
            out += [(c.id, c.lease_version) for c in got.claimed]
        return out

    # The one-message handler's finish says whether the row is a group's member (known from its
    # start, DESIGN invariant 29) where the package has groups: that is the worker's path.
    from outbox_celery.db import completer as complete

    grouped: dict[str, Any] = {"grouped": False} if "grouped" in complete.Finish.__dataclass_fields__ else {}

    def deliver(conn: psycopg.Connection[Any], store: Store, outcome: str, i: int, v: int) -> None:
        lease = [complete.Lease(i, v)]
        assert store.completer.start(
            conn, lease, lease=LEASE, max_attempts=MAX_ATTEMPTS, starter=starter_token()
        )
        if outcome == "done":
            finish = complete.Finish(complete.Lease(i, v), complete.Step.DONE, ordered=False, **grouped)
            assert store.completer.finish(conn, [finish], max_attempts=0, max_age=0.0).of(i)
        else:
            finish = complete.Finish(complete.Lease(i, v), complete.Step.RETRY, 60.0, "503", **grouped)
            assert store.completer.finish(conn, [finish], max_attempts=MAX_ATTEMPTS, max_age=0.0).of(i)

    def claim_runs(db: str, conn: psycopg.Connection[Any], backend: int, n: int) -> dict[str, float]:
        """``n`` claim runs of one row each on ``conn`` (what a push listener runs per
        notification at a low rate: claim lock, in-flight count, claim), each row inserted
        before and delivered after on a connection of its own, outside the measurement."""
        import contextlib

        from outbox_celery import OutboxConfig, TableName
        from outbox_celery.claim.claimer import Claimer
        from outbox_celery.handlers import HandlerSpec

        migrate(conn, "bench_claim_run")
        store = Store("bench_claim_run")
        handlers = {"bench.noop": HandlerSpec("bench.noop", _noop, "bench")}
        config = OutboxConfig(dsn=db, table=TableName.parse("bench_claim_run"), lease=LEASE)
        claimer = Claimer(config, lambda: contextlib.nullcontext(conn), handlers, store=store)
        claimed: list[Any] = []

        def publish(claims: Any) -> int:
            claimed.extend(claims)
            return len(claims)

        wall = cpu = 0.0
        server: float | None = None
        with psycopg.connect(db, autocommit=True) as other:
            for k in range(n + 20):  # the first 20 warm up, as above
                if k == 20:
                    # Only the claim runs use this backend: its CPU over the loop is theirs.
                    server = _backend_cpu(backend)
                fill_pending(other, "bench_claim_run", 1)
                claimed.clear()
                w, c = time.perf_counter(), time.process_time()
                claimer.run(publish)
                if k >= 20:
                    wall += time.perf_counter() - w
                    cpu += time.process_time() - c
                for x in claimed:
                    deliver(other, store, "done", x.id, x.lease_version)
        figures = {"claim run": wall / n * 1e6, "claim run client cpu": cpu / n * 1e6}
        after = _backend_cpu(backend)
        if server is not None and after is not None:
            figures["claim run server cpu"] = (after - server) / n * 1e6
        return figures

    out: dict[str, float] = {}
    with temporary_database(dsn, prefix="outbox_bench") as db, psycopg.connect(db, autocommit=True) as conn:
        migrate(conn, "bench_finalize")
        store = Store("bench_finalize")
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
        backend = int(row[0]) if row else 0
        for outcome in OUTCOMES:
            fill_pending(conn, "bench_finalize", rows + 20)
            if stale_stats:
                conn.execute("ANALYZE bench_finalize")
            leases = claim(conn, store, rows + 20)
            for i, v in leases[:20]:  # warm up: psycopg prepares a statement after five runs
                deliver(conn, store, outcome, i, v)
            started, cpu, server = time.perf_counter(), time.process_time(), _backend_cpu(backend)
            for i, v in leases[20:]:
                deliver(conn, store, outcome, i, v)
            out[outcome] = (time.perf_counter() - started) / rows * 1e6
            out[f"{outcome} client cpu"] = (time.process_time() - cpu) / rows * 1e6
            after = _backend_cpu(backend)
            if server is not None and after is not None:
                out[f"{outcome} server cpu"] = (after - server) / rows * 1e6
        out.update(claim_runs(db, conn, backend, rows))
    return out


def _extract(ref: str, into: Path) -> None:
    """``outbox_celery`` as it is at ``ref``, into ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", ref, "outbox_celery"],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")


def _run(package_root: Path, dsn: str, rows: int, stale_stats: bool) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package_root), str(ROOT)])}
    stale = ["--stale-stats"] if stale_stats else []
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.finalize", "--child", "--dsn", dsn, "--rows", str(rows), *stale],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        cwd=package_root,
    )
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--dsn", default=os.environ.get("OUTBOX_BENCH_DSN", "postgresql://postgres@127.0.0.1/postgres")
    )
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", default="main", help="git ref of the baseline package")
    parser.add_argument(
        "--stale-stats", action="store_true", help="analyze before the claim: statistics say no lease is live"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.dsn, args.rows, stale_stats=args.stale_stats)))
        return
    import psycopg

    with psycopg.connect(args.dsn) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    samples: dict[str, dict[str, list[float]]] = {"baseline": {}, "this tree": {}}
    with tempfile.TemporaryDirectory() as tmp:
        _extract(args.baseline, Path(tmp))
        roots = {"baseline": Path(tmp), "this tree": ROOT}
        for r in range(args.rounds):
            for name in roots if r % 2 == 0 else reversed(list(roots)):
                for outcome, us in _run(roots[name], args.dsn, args.rows, args.stale_stats).items():
                    samples[name].setdefault(outcome, []).append(us)
    print(
        f"one-row start + finalize, us per delivery, and claim runs of one row (median of {args.rounds} "
        f"alternated rounds of "
        f"{args.rows}, {args.rows + 20} live leases); PostgreSQL {row[0] if row else '?'}; baseline "
        f"{args.baseline}{'; statistics analyzed before the claim' if args.stale_stats else ''}"
    )
    print(f"{'figure':<20} {'baseline':>10} {'this tree':>10} {'ratio':>6}")
    for figure in samples["this tree"]:
        if figure not in samples["baseline"]:
            continue
        base = statistics.median(samples["baseline"][figure])
        new = statistics.median(samples["this tree"][figure])
        print(f"{figure:<20} {base:>10.1f} {new:>10.1f} {new / base:>6.2f}")


if __name__ == "__main__":
    main()
