"""The demo: run the orders stack, push orders through it, show what PostgreSQL says, stop.

``python -m examples.demo [--orders 300] [--no-flower] [--linger] ...`` (``make demo``).

With ``OUTBOX_DSN`` unset it starts an embedded PostgreSQL 18 in ``.outbox-demo/pg``; with
``CELERY_BROKER_URL`` unset an embedded Redis. Everything it starts runs in its own process group
and is stopped on the way out, on success, failure, Ctrl-C or SIGTERM alike.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg

from examples.orders import settings
from outbox_celery.dsn import redact
from outbox_celery.testing import free_port

from .processes import ChildExitedError, Supervisor
from .report import EVENTS_PER_ORDER, Snapshot, checks, snapshot

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[2]
APP = "examples.orders.app"
# Stop order: no new claims first, then let the workers finish what they hold (the receiver is
# still up to answer them), then the rest.
STOP_ORDER = (("beat",), ("worker-claim", "worker-webhooks", "worker-fulfilment"))
# The receiver's rate limit: below what the webhook workers would send, so it binds and its
# 429s (RateLimited: the event type waits on every worker) show in the summary.
MAX_RATE = 100


class Interrupted(Exception):  # noqa: N818 - a request, not an error
    """Ctrl-C or SIGTERM: stop everything, report, exit 130."""


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m examples.demo",
        description="Run the orders example stack on real PostgreSQL, broker and Celery processes.",
    )
    p.add_argument("--orders", type=int, default=300, help="orders to push (default 300)")
    p.add_argument("--no-flower", action="store_true", help="do not start Flower")
    p.add_argument("--flower-port", type=int, default=5555, help="Flower's port (default 5555)")
    p.add_argument("--no-console", action="store_true", help="do not start the operator console")
    p.add_argument("--console-port", type=int, default=8808, help="the console's port (default 8808)")
    p.add_argument(
        "--state-dir",
        default=str(ROOT / ".outbox-demo"),
        help="embedded databases, logs and beat state (default .outbox-demo/)",
    )
    p.add_argument("--fresh", action="store_true", help="delete the embedded PostgreSQL/Redis data first")
    p.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds")
    p.add_argument(
        "--max-rate",
        type=int,
        default=MAX_RATE,
        help=f"receiver answers 429 to requests beyond N a second (default {MAX_RATE}; 0: off)",
    )
    p.add_argument(
        "--drop-every",
        type=int,
        default=10,
        help="receiver commits, then drops the connection, for 1 event in N once (0: off)",
    )
    p.add_argument(
        "--invoice-every",
        type=int,
        default=10,
        help="1 order in N is shipped before it is paid: its shipping notification is deferred",
    )
    p.add_argument("--json", metavar="PATH", help="also write the summary as JSON")
    p.add_argument(
        "--linger", action="store_true", help="keep the stack running after the summary until Ctrl-C"
    )
    args = p.parse_args(argv)
    if args.orders < 1:
        p.error("--orders must be at least 1")
    return args


class Output:
    """Progress refreshed in place on a terminal, one line per second otherwise."""

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self._open_line = False

    def line(self, text: str = "") -> None:
        """Print a permanent line."""
        if self._open_line:
            sys.stdout.write("\n")
            self._open_line = False
        print(text, flush=True)

    def progress(self, text: str) -> None:
        """Print a progress line (overwritten by the next one on a terminal)."""
        if self.tty:
            # One screen line, or the carriage return cannot overwrite it.
            width = shutil.get_terminal_size().columns - 1
            sys.stdout.write("\r\x1b[2K" + text[:width])
            sys.stdout.flush()
            self._open_line = True
        else:
            print(text, flush=True)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as r:
            return bool(200 <= r.status < 300)
    except (OSError, urllib.error.URLError):
        return False


def _post(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body or {}).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        answer: dict[str, Any] = json.loads(r.read())
        return answer


class Signals:
    """Ctrl-C/SIGTERM/SIGHUP raise :class:`Interrupted` once; afterwards they only hurry the stop.

    :meth:`stopping` is called when the shutdown starts, so that a second Ctrl-C cannot abort
    the cleanup half way; it then runs the ``on_hurry`` callbacks instead (SIGKILL sooner).
    Inside :meth:`deferred` a signal is held until the block ends, so that a process or an
    embedded server is never started without being recorded for the shutdown.
    """

    def __init__(self) -> None:
        self._stopping = False
        self._deferring = 0
        self._held: str | None = None
        self.on_hurry: list[Callable[[], None]] = []

    def stopping(self) -> None:
        """From now on signals hurry the shutdown instead of interrupting it."""
        self._stopping = True

    def _handle(self, signum: int, frame: Any) -> None:
        if self._stopping:
            for fn in self.on_hurry:
                fn()
            return
        name = signal.Signals(signum).name
        if self._deferring:
            self._held = self._held or name
            return
        self._stopping = True
        raise Interrupted(name)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Hold signals during the block; act on a held one at its end."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
        if not self._deferring and self._held and not self._stopping:
            self._stopping = True
            raise Interrupted(self._held)

    @contextlib.contextmanager
    def installed(self) -> Iterator[Signals]:
        """Install the handlers; restore the previous ones on exit."""
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h)


class Pusher(threading.Thread):
    """Drives the orders through the API like a shop would: create, pay, ship.

    One order in ``invoice_every`` is shipped before it is paid; it is paid once its
    ``order.shipped`` event has been deferred (or after ``pay_later`` seconds).
    """

    def __init__(
        self,
        api: str,
        count: int,
        source: str,
        *,
        invoice_every: int,
        deferred: Callable[[list[int]], int],
        pay_later: float = 60.0,
    ) -> None:
        super().__init__(name="demo-pusher", daemon=True)
        self.api = api
        self.count = count
        self.source = source
        self.invoice_every = invoice_every
        self.deferred = deferred
        self.pay_later = pay_later
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.finished = False
        self.phase = "starting"

    def _each(self, pool: ThreadPoolExecutor, fn: Callable[[int], Any], items: list[int]) -> list[Any]:
        results = []
        for result in pool.map(fn, items):
            results.append(result)
            if self.stop.is_set():
                raise Interrupted("stopped")
        return results

    def run(self) -> None:
        try:
            with ThreadPoolExecutor(4, thread_name_prefix="demo-http") as pool:
                self.phase = "creating orders"

                def create(i: int) -> int:
                    body = {
                        "customer": f"customer-{i % 97}",
                        "total_cents": 500 + 37 * i,
                        "source": self.source,
                    }
                    return int(_post(f"{self.api}/orders", body)["id"])

                ids = self._each(pool, create, list(range(self.count)))
                every = self.invoice_every
                invoice = [oid for n, oid in enumerate(ids) if every > 0 and n % every == every - 1]
                invoice_set = set(invoice)
                regular = [oid for oid in ids if oid not in invoice_set]
                self.phase = "paying orders, shipping invoice orders"
                self._each(pool, lambda oid: _post(f"{self.api}/orders/{oid}/pay"), regular)
                self._each(pool, lambda oid: _post(f"{self.api}/orders/{oid}/ship"), invoice)
                self.phase = "shipping orders"
                self._each(pool, lambda oid: _post(f"{self.api}/orders/{oid}/ship"), regular)
                if invoice:
                    self.phase = "invoice orders wait for payment"
                    deadline = time.monotonic() + self.pay_later
                    while time.monotonic() < deadline and self.deferred(invoice) < len(invoice):
                        if self.stop.wait(0.25):
                            raise Interrupted("stopped")
                    self.phase = "paying invoice orders"
                    self._each(pool, lambda oid: _post(f"{self.api}/orders/{oid}/pay"), invoice)
                self.phase = "all orders written"
        except BaseException as exc:
            self.error = exc
        finally:
            self.finished = True


def _deferred_counter(dsn: str) -> Callable[[list[int]], int]:
    """How many of these orders' ``order.shipped`` events were deferred at least once so far."""
    query = (
        "SELECT count(*) FROM outbox WHERE event_type = 'order.shipped' AND aggregate_type = 'order'"
        " AND aggregate_id = ANY(%s) AND lease_version > attempts + (status = 'processing')::int"
    )

    def count(order_ids: list[int]) -> int:
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(query, [[str(i) for i in order_ids]]).fetchone()
        return int(row[0]) if row else 0

    return count


def _progress_text(elapsed: float, snap: Snapshot, expected: int, phase: str) -> str:
    return (
        f"{elapsed:6.1f}s  orders {snap.orders}/{expected}  events {snap.events}: "
        f"done {snap.done}  pending {snap.pending}  in flight {snap.processing}  dead {snap.dead}  | "
        f"retried {snap.retried}  deferred {snap.deferred}  oldest pending {snap.oldest_pending:.1f}s  | "
        f"webhook: {snap.applied} applied  {snap.duplicates} dup  {snap.throttled} x429  "
        f"{snap.dropped} dropped  [{phase}]"
    )


def _summary(out: Output, snap: Snapshot, expected: int) -> bool:
    verdicts = checks(snap, expected)
    by_type = ", ".join(f"{k} {v}" for k, v in sorted(snap.by_type.items()))
    queues: dict[str, int] = {}
    from examples.orders.app import outbox  # after the environment is set

    for event_type, n in snap.by_type.items():
        queue = outbox.queue_for(event_type)
        queues[queue] = queues.get(queue, 0) + n
    by_queue = ", ".join(f"{k} {v}" for k, v in sorted(queues.items()))
    rate = snap.done / snap.seconds if snap.seconds > 0 else 0.0
    out.line()
    out.line("Summary (every number read from PostgreSQL)")
    out.line(f"  orders    {snap.orders} written by this run, each created, paid and shipped")
    out.line(
        f"  outbox    {snap.events} events: {snap.done} done, {snap.dead} dead, {snap.unfinished} unfinished"
    )
    out.line(f"            by type:  {by_type}")
    out.line(f"            by queue: {by_queue}")
    out.line(
        f"  attempts  {snap.attempts} handler runs for {snap.events} events: {snap.retried} retried "
        f"(dropped connections); {snap.deferred} held back with their attempt refunded (Defer until "
        "paid, RateLimited after a 429: claimed more often than attempted)"
    )
    out.line(
        f"  receiver  {snap.requests} webhook requests: {snap.applied} applied "
        f"({snap.dropped} of them then lost their answer), {snap.duplicates} redeliveries ignored, "
        f"{snap.throttled} answered 429 (over --max-rate)"
    )
    out.line(f"            inbox holds {snap.inbox} idempotency keys; {snap.effects} effects applied")
    out.line(f"  ordering  status changes out of sequence at the receiver: {snap.out_of_order}")
    out.line(
        f"  receipts  {snap.receipts} written for {snap.paid} paid orders by the order.paid@receipt "
        "subscription (transactional: each insert committed with its done)"
    )
    out.line(
        f"  time      {snap.seconds:.1f}s from the first event written to the last delivered ({rate:.0f}/s)"
    )
    for v in verdicts:
        out.line(f"  [{'ok' if v.ok else 'FAILED'}] {v.text}")
    return all(v.ok for v in verdicts)


def _wait_ready(sup: Supervisor, out: Output, checks_: dict[str, Callable[[], bool]], timeout: float) -> None:
    pending = dict(checks_)
    deadline = time.monotonic() + timeout
    while pending:
        sup.check()
        for name, ready in list(pending.items()):
            if ready():
                pending.pop(name)
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"not ready after {timeout:.0f}s: {', '.join(pending)}")
        time.sleep(0.3)


def _workers_ready(names: list[str]) -> Callable[[], bool]:
    from examples.orders.app import app

    def ready() -> bool:
        try:
            replies = app.control.ping(destination=names, timeout=0.5) or []
        except Exception:
            return False
        seen = {node for reply in replies for node in reply}
        return set(names) <= seen

    return ready


def _run(args: argparse.Namespace, out: Output, signals: Signals) -> int:
    state = Path(args.state_dir).resolve()
    if args.fresh:
        for sub in ("pg", "redis"):
            shutil.rmtree(state / sub, ignore_errors=True)
    state.mkdir(parents=True, exist_ok=True)
    out.line(f"outbox-celery demo: {args.orders} orders through the example orders stack")
    out.line(f"  state and logs in {state}")
    with contextlib.ExitStack() as stack:
        try:
            dsn = os.environ.get("OUTBOX_DSN")
            if dsn:
                out.line(f"  PostgreSQL: {redact(dsn)} (OUTBOX_DSN)")
            else:
                from outbox_celery.testing import embedded_postgres

                out.line("  PostgreSQL: starting an embedded server (set OUTBOX_DSN to use yours)")
                with signals.deferred():
                    dsn = stack.enter_context(embedded_postgres(state / "pg"))
            with psycopg.connect(dsn, autocommit=True) as conn:
                row = conn.execute("SHOW server_version").fetchone()
                out.line(f"  PostgreSQL {row[0] if row else '?'} is up")
            broker = os.environ.get("CELERY_BROKER_URL")
            if broker:
                out.line(f"  broker: {redact_url(broker)} (CELERY_BROKER_URL)")
            else:
                from outbox_celery.testing import embedded_redis

                with signals.deferred():
                    broker = stack.enter_context(embedded_redis(state / "redis"))
                out.line(f"  broker: embedded Redis at {broker} (set CELERY_BROKER_URL to use yours)")

            receiver_port, api_port = free_port(), free_port()
            env = dict(os.environ)
            env.update(
                OUTBOX_DSN=dsn,
                RECEIVER_DSN=dsn,
                CELERY_BROKER_URL=broker,
                WEBHOOK_URL=f"http://127.0.0.1:{receiver_port}/webhooks",
                RECEIVER_PORT=str(receiver_port),
                API_PORT=str(api_port),
                CELERY_BEAT_SCHEDULE=str(state / "celerybeat-schedule"),
                PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
                PYTHONUNBUFFERED="1",
            )
            # The demo process itself talks to the same services (pings, the summary's queue names).
            os.environ.update({k: env[k] for k in ("OUTBOX_DSN", "CELERY_BROKER_URL", "WEBHOOK_URL")})

            migrated = subprocess.run(
                [sys.executable, "-m", "examples.orders.migrate"],
                env=env,
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=False,
            )
            if migrated.returncode != 0:
                out.line(f"migration failed:\n{migrated.stdout}{migrated.stderr}")
                return 1
            out.line(f"  {migrated.stdout.strip()}")

            sup = Supervisor(state / "logs", env=env, cwd=ROOT, guard=signals.deferred)

            def hurry() -> None:
                sup.hurry = True

            signals.on_hurry.append(hurry)

            def stop_everything() -> None:
                signals.stopping()
                if sup.children:
                    out.line(f"stopping {len(sup.children)} processes...")
                sup.stop_all(STOP_ORDER)
                left = sup.survivors()
                if left:
                    out.line(f"  WARNING: still running after SIGKILL: {', '.join(left)}")
                elif sup.children:
                    out.line(f"  all {len(sup.children)} processes stopped")

            stack.callback(stop_everything)
            return _run_stack(args, out, sup, state, dsn, receiver_port, api_port)
        finally:
            # From here on a signal hurries the shutdown instead of interrupting it.
            signals.stopping()
    raise AssertionError("unreachable")  # pragma: no cover


def redact_url(url: str) -> str:
    """A broker URL without its password."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password:
        host = parts.hostname or ""
        if parts.port:
            host = f"{host}:{parts.port}"
        netloc = f"{parts.username or ''}:***@{host}"
        return urlunsplit(parts._replace(netloc=netloc))
    return url


def _run_stack(
    args: argparse.Namespace,
    out: Output,
    sup: Supervisor,
    state: Path,
    dsn: str,
    receiver_port: int,
    api_port: int,
) -> int:
    """Start the stack, push the orders, report; the exit code (0: every check passed)."""
    flower_url = _start_stack(args, out, sup, receiver_port, api_port)
    source, final = _push_and_watch(args, out, sup, dsn, api_port)
    ok = _report(args, out, sup, source, final, flower_url)
    if args.linger:
        _linger(out, sup, flower_url)
    return 0 if ok else 1


def _start_stack(
    args: argparse.Namespace, out: Output, sup: Supervisor, receiver_port: int, api_port: int
) -> str | None:
    """Start receiver, API, workers, beat (and Flower) and wait until each is ready; Flower's URL."""
    py = sys.executable
    celery = [py, "-m", "celery", "-A", APP]
    quiet = ["--without-gossip", "--without-mingle", "--loglevel", "INFO"]
    sup.start(
        "receiver",
        [
            py,
            "-m",
            "examples.orders.receiver",
            "--max-rate",
            str(args.max_rate),
            "--drop-every",
            str(args.drop_every),
        ],
    )
    sup.start("api", [py, "-m", "examples.orders.api"])
    workers = {
        "worker-claim": ["-Q", settings.CLAIM_QUEUE, "--pool", "solo", "-n", "demo-claim@%h"],
        "worker-webhooks": ["-Q", settings.WEBHOOKS_QUEUE, "--concurrency", "4", "-n", "demo-webhooks@%h"],
        "worker-fulfilment": [
            "-Q",
            f"{settings.FULFILMENT_QUEUE},{settings.LEDGER_QUEUE}",
            "--concurrency",
            "2",
            "-n",
            "demo-fulfilment@%h",
        ],
    }
    for name, opts in workers.items():
        sup.start(name, [*celery, "worker", *opts, *quiet])
    sup.start("beat", [*celery, "beat", "--loglevel", "INFO"])
    flower_url = None
    if not args.no_flower:
        port = args.flower_port
        if not _port_free(port):
            new = free_port()
            out.line(f"  port {port} is busy; Flower gets {new}")
            port = new
        sup.start("flower", [*celery, "flower", f"--port={port}", "--address=127.0.0.1"])
        flower_url = f"http://127.0.0.1:{port}"
    console_url = None
    if not args.no_console:
        port = args.console_port if _port_free(args.console_port) else free_port()
        # Read-only (no --actions), so it needs no login; its task ids link to Flower.
        command = [py, "-m", "outbox_celery", "web", f"--port={port}"]
        sup.start("console", command + ([f"--flower-url={flower_url}"] if flower_url else []))
        console_url = f"http://127.0.0.1:{port}/"

    host = socket.gethostname()
    ready: dict[str, Callable[[], bool]] = {
        "receiver": lambda: _http_ok(f"http://127.0.0.1:{receiver_port}/health"),
        "api": lambda: _http_ok(f"http://127.0.0.1:{api_port}/health"),
        "workers": _workers_ready([f"demo-{q}@{host}" for q in ("claim", "webhooks", "fulfilment")]),
    }
    if flower_url:
        ready["flower"] = lambda: _http_ok(f"{flower_url}/healthcheck")
    if console_url:
        ready["console"] = lambda: _http_ok(console_url)
    t0 = time.monotonic()
    _wait_ready(sup, out, ready, timeout=120.0)
    out.line(
        f"  up in {time.monotonic() - t0:.1f}s: receiver :{receiver_port}, api :{api_port}, "
        f"3 workers (queues {settings.CLAIM_QUEUE}, {settings.WEBHOOKS_QUEUE}, "
        f"{settings.FULFILMENT_QUEUE} with {settings.LEDGER_QUEUE}), beat"
        + (", flower" if flower_url else "")
    )
    if flower_url:
        out.line(f"  Flower: {flower_url}  (live while the demo runs)")
    if console_url:
        out.line(f"  Console: {console_url}  (outbox-celery web, read-only; live while the demo runs)")
    out.line(f"  logs: {sup.log_dir}")
    return flower_url


def _push_and_watch(
    args: argparse.Namespace, out: Output, sup: Supervisor, dsn: str, api_port: int
) -> tuple[str, Snapshot]:
    """Push the orders and follow them until every event finished (or the timeout)."""
    source = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    pusher = Pusher(
        f"http://127.0.0.1:{api_port}",
        args.orders,
        source,
        invoice_every=args.invoice_every,
        deferred=_deferred_counter(dsn),
    )
    out.line(f"pushing {args.orders} orders (run {source})")
    started = time.monotonic()
    pusher.start()
    expected_events = args.orders * EVENTS_PER_ORDER
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while True:
                sup.check()
                if pusher.error is not None:
                    raise RuntimeError(f"pushing orders failed: {pusher.error!r}")
                snap = snapshot(conn, source)
                elapsed = time.monotonic() - started
                out.progress(_progress_text(elapsed, snap, args.orders, pusher.phase))
                if pusher.finished and snap.events >= expected_events and snap.unfinished == 0:
                    break
                if elapsed > args.timeout:
                    out.line(f"timed out after {args.timeout:.0f}s")
                    break
                time.sleep(1.0)
            final = snapshot(conn, source, full=True)
    finally:
        pusher.stop.set()
    return source, final


def _report(
    args: argparse.Namespace,
    out: Output,
    sup: Supervisor,
    source: str,
    final: Snapshot,
    flower_url: str | None,
) -> bool:
    """Print the checks (and write ``--json``); whether every check passed."""
    ok = _summary(out, final, args.orders)
    if args.json:
        payload = {
            "ok": ok,
            "source": source,
            "orders_requested": args.orders,
            "snapshot": final.as_dict(),
            "checks": [{"ok": c.ok, "text": c.text} for c in checks(final, args.orders)],
            "pids": sup.pids,
            "flower": flower_url,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return ok


def _linger(out: Output, sup: Supervisor, flower_url: str | None) -> None:
    """Keep the stack running until Ctrl-C (``--linger``)."""
    where = f"; Flower: {flower_url}" if flower_url else ""
    out.line(f"the stack keeps running (--linger){where}; Ctrl-C stops it")
    try:
        while True:
            sup.check()
            time.sleep(1.0)
    except Interrupted:
        pass  # the expected way out of --linger


def main(argv: list[str] | None = None) -> int:
    """Run the demo; exit 0 when every check passed, 1 when one failed, 130 when interrupted."""
    args = _parse(argv)
    # embedded-postgres asks platformdirs for a runtime directory; its fallback is fine.
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR")
    out = Output()
    with Signals().installed() as signals:
        try:
            return _run(args, out, signals)
        except Interrupted as exc:
            out.line(f"interrupted ({exc}); everything the demo started has been stopped")
            return 130
        except ChildExitedError as exc:
            out.line(f"FAILED: {exc}; the end of its log ({exc.child.log}):")
            out.line(exc.child.tail())
            return 1
        except (TimeoutError, RuntimeError) as exc:
            out.line(f"FAILED: {exc}")
            return 1
