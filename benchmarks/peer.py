"""The nearest peer, django-celery-outbox, run end to end like our pipelines (``--only peer``).

django-celery-outbox (PyPI) turns ``task.delay()`` inside a Django transaction into an outbox row;
its relay (``manage.py celery_outbox_relay``) publishes rows to the broker and deletes them. It is
installed into its own virtual environment (created once and kept in the user's cache directory,
with the same Celery version as ours), so nothing of it reaches this project's environment. When
it cannot be installed (no package index), :func:`peer_python` says why and the section prints
that line instead of figures.

One run: a worker (same pool, concurrency, prefetch and worker flags as ours, a no-op task with
``acks_late``), the relay, and a producer that commits ``n`` ``delay()`` calls in transactions of
``producer_batch``, all at the same time; a message is finished in ``task_postrun`` (the same
shared-memory counter as ours, :mod:`benchmarks.counter`).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
import uuid
import venv
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from .counter import CompletionCounter
from .measure import backend_pids, cpu_seconds, db_per_message, last_json_line, listening_pid, pg_counters
from .pipeline import WORKER_FLAGS, Pipeline, PipelineResult, _broker_name, _broker_port, cleanup_queues
from .procs import ROOT, Processes, wait_for

__all__ = ["PEER", "PEER_VERSION", "PeerRun", "peer_python"]

PEER = "django-celery-outbox"
PEER_VERSION = "0.4.3"
# Its relay's defaults, and the settings tuned for throughput measured against it.
TUNED = ("--batch-size", "500", "--idle-time", "0.1")
TABLES = ("django_celery_outbox_celeryoutbox", "django_celery_outbox_celeryoutboxdeadletter")


def peer_python(cache: Path | None = None) -> tuple[Path | None, str]:
    """The peer's interpreter (installing it on first use), or ``None`` and the reason it is missing."""
    celery = metadata.version("celery")
    root = cache or Path.home() / ".cache" / "outbox-celery-bench"
    env_dir = root / f"peer-{PEER_VERSION}-celery-{celery}-py{sys.version_info[0]}{sys.version_info[1]}"
    python = env_dir / "bin" / "python"
    ready = env_dir / ".installed"
    if ready.exists():
        return python, f"{PEER} {PEER_VERSION} (celery {celery})"
    root.mkdir(parents=True, exist_ok=True)
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    # sentry-sdk 3 dropped start_span(op=...), which the peer's send_task calls on every task.
    wanted = [
        f"{PEER}=={PEER_VERSION}",
        f"celery[redis]=={celery}",
        "psycopg[binary]>=3.1",
        "psutil",
        "sentry-sdk<3",
    ]
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *wanted],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        return None, f"{PEER} {PEER_VERSION} could not be installed ({last}); the peer is left out"
    ready.write_text(" ".join(wanted))
    return python, f"{PEER} {PEER_VERSION} (celery {celery})"


def _settings(dsn: str) -> str:
    info = conninfo_to_dict(dsn)
    db = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": info.get("dbname", ""),
        "USER": info.get("user", ""),
        "PASSWORD": info.get("password", ""),
        "HOST": info.get("host", ""),
        "PORT": str(info.get("port", "")),
    }
    return textwrap.dedent(
        f"""\
        SECRET_KEY = "benchmark-only"
        USE_TZ = True
        INSTALLED_APPS = ["django_celery_outbox"]
        DATABASES = {{"default": {db!r}}}
        # Persistent connections (Django's setting for long-running processes): the relay keeps
        # one backend through the run, whose CPU the benchmark counts (it would otherwise
        # reconnect on every loop, and the backends that exited would go uncounted).
        DATABASES["default"]["CONN_MAX_AGE"] = None
        CELERY_OUTBOX_APP = "peerbench.celeryapp.app"
        LOGGING_CONFIG = None
        """
    )


_CELERY_APP = '''\
"""The peer's Celery app: one no-op task, configured like the bare baseline (see app_bare.py)."""
import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "peerbench.settings")
django.setup()

from django_celery_outbox import OutboxCelery  # noqa: E402

from benchmarks import hooks  # noqa: E402

app = OutboxCelery("peerbench", broker=os.environ.get("BENCH_BROKER_URL", "memory://"))
app.conf.update(
    task_default_queue=os.environ.get("BENCH_QUEUE", "bench.peer"),
    worker_prefetch_multiplier=int(os.environ.get("BENCH_PREFETCH", "1")),
    task_ignore_result=True,
    worker_send_task_events=False,
    broker_connection_retry_on_startup=True,
)


@app.task(name="bench.noop", ignore_result=True, acks_late=True)
def noop(i):
    """Do nothing (the same handler as ours and bare Celery's)."""


hooks.install()
'''

_PRODUCE = '''\
"""The peer's producer: BENCH_N delay() calls committed in transactions of BENCH_PRODUCER_BATCH."""
import json
import os
import time

from django.db import transaction

from peerbench.celeryapp import noop

n = int(os.environ["BENCH_N"])
batch = int(os.environ.get("BENCH_PRODUCER_BATCH", "100"))
started, cpu = time.time(), time.process_time()
sent = 0
while sent < n:
    size = min(batch, n - sent)
    with transaction.atomic():
        for j in range(size):
            noop.delay(sent + j)
    sent += size
print(json.dumps({"started": started, "finished": time.time(), "sent": sent,
                  "cpu": time.process_time() - cpu}), flush=True)
'''


@dataclass
class PeerRun:
    """Runs the peer end to end beside our pipelines (same workdir, DSN and worker settings)."""

    python: Path
    pipeline: Pipeline

    def _project(self, dsn: str) -> Path:
        root = self.pipeline.workdir / "peer"
        pkg = root / "peerbench"
        if not pkg.exists():
            pkg.mkdir(parents=True)
            (pkg / "__init__.py").write_text("")
            (pkg / "settings.py").write_text(_settings(dsn))
            (pkg / "celeryapp.py").write_text(_CELERY_APP)
            (pkg / "produce.py").write_text(_PRODUCE)
            done = subprocess.run(
                [str(self.python), "-m", "django", "migrate", "-v", "0", "--settings", "peerbench.settings"],
                cwd=root,
                env={**os.environ, "PYTHONPATH": f"{root}:{ROOT}"},
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            if done.returncode != 0:
                raise RuntimeError(f"the peer's migrate failed:\n{done.stdout}{done.stderr}")
        return root

    def run(
        self,
        broker_url: str,
        n: int,
        *,
        tuned: bool = False,
        prefetch: int = 1,
        producer_batch: int = 100,
        warmup: int = 1000,
    ) -> PipelineResult:
        """One run of ``n`` messages (after ``warmup`` unmeasured ones); relay defaults or tuned."""
        p = self.pipeline
        root = self._project(p.dsn)
        run = f"peer-{uuid.uuid4().hex[:6]}"
        queue = f"bench.peer.{run}"
        counter = CompletionCounter.create(p.workdir / f"{run}.counter")
        env = {
            "PYTHONPATH": f"{root}:{ROOT}",
            "DJANGO_SETTINGS_MODULE": "peerbench.settings",
            "BENCH_BROKER_URL": broker_url,
            "BENCH_QUEUE": queue,
            "BENCH_PREFETCH": str(prefetch),
            "BENCH_PRODUCER_BATCH": str(producer_batch),
        }
        broker = [x for x in [listening_pid(_broker_port(broker_url))] if x is not None]
        py = str(self.python)
        try:
            with Processes(p.workdir) as procs, psycopg.connect(p.dsn, autocommit=True) as admin:
                ready = p.workdir / f"{run}.ready"
                args = ["worker", "-Q", queue, "-P", p.pool, "-c", str(p.concurrency), "-n", f"{run}@%h"]
                args += [*WORKER_FLAGS, "--prefetch-multiplier", str(prefetch)]
                worker = procs.start(
                    f"worker-{run}",
                    [py, "-m", "celery", "-A", "peerbench.celeryapp:app", *args],
                    {**env, "BENCH_COUNTER": str(counter.path), "BENCH_READY": str(ready)},
                )
                relay = procs.start(
                    f"relay-{run}",
                    [py, "-m", "django", "celery_outbox_relay", *(TUNED if tuned else ())],
                    env,
                )
                wait_for(ready, [worker, relay], 60)

                def load(count: int) -> tuple[dict[str, Any], int, float]:
                    base, _ = counter.read()
                    gen = procs.start(
                        f"produce-{uuid.uuid4().hex[:4]}",
                        [py, "-m", "peerbench.produce"],
                        {
                            **env,
                            "BENCH_N": str(count),
                        },
                    )
                    done, last = p._wait(counter, base + count, [worker, relay, gen])
                    gen.popen.wait(30)
                    return last_json_line(gen.log), done - base, last

                # Statistics before the warm-up and after every process exited, as ours
                # (pipeline.outbox): backends report theirs with a delay, or on exit.
                pg0 = pg_counters(admin)
                if warmup:
                    load(warmup)
                cpu0 = {
                    "worker": cpu_seconds(worker.tree()),
                    "relay": cpu_seconds(relay.tree()),
                    "broker": cpu_seconds(broker),
                }
                # The PostgreSQL backends of the benchmark's database (the relay's, the
                # producer's), as the outbox pipelines count theirs.
                backends0 = {b.pid: cpu_seconds([b]) for b in backend_pids(admin)}
                summary, done, last = load(n)
                cpu = {
                    "worker": cpu_seconds(worker.tree()) - cpu0["worker"],
                    "relay": cpu_seconds(relay.tree()) - cpu0["relay"],
                    "producer": float(summary.get("cpu", 0.0)),
                    "broker": cpu_seconds(broker) - cpu0["broker"],
                    "postgres": sum(cpu_seconds([b]) - backends0.get(b.pid, 0) for b in backend_pids(admin)),
                }
                procs.stop_all()
                time.sleep(0.5)  # exiting backends flush their statistics
                db = db_per_message(pg0, pg_counters(admin), n + warmup)
        finally:
            counter.close()
            cleanup_queues(broker_url, [queue])
            with contextlib.suppress(psycopg.Error), psycopg.connect(p.dsn, autocommit=True) as conn:
                for table in TABLES:
                    conn.execute(f"TRUNCATE {table}")  # constant names, no external input
        started = float(summary["started"])
        return PipelineResult(
            kind="peer tuned" if tuned else "peer",
            broker=_broker_name(broker_url),
            n=n,
            seconds=last - started,
            send_seconds=float(summary["finished"]) - started,
            completed=done,
            cpu_ms_per_msg={k: 1000 * v / n for k, v in cpu.items()},
            db_per_msg=db,
            settings={
                "prefetch": prefetch,
                "concurrency": p.concurrency,
                "pool": p.pool,
                "warmup": warmup,
                "relay": " ".join(TUNED) if tuned else "defaults",
            },
        )
