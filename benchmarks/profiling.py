"""Sampling profiles of an end-to-end run with py-spy, summarized per process role.

py-spy attaches to the running delivery worker (with its pool children) and claim worker and
records raw collapsed stacks. :func:`summarize` turns them into "where the time goes": the share
of busy samples spent in each function itself (self) and below it (inclusive), with idle
samples (an event loop waiting in ``epoll``, a pool child waiting for its next job) left out.
py-spy samples wall-clock time of threads that are not idle, so a thread blocked on a
PostgreSQL or broker reply, or runnable but preempted on a busy machine, counts where it waits.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Profiler", "summarize"]

# Frames that say "waiting in the event loop" rather than "working".
_IDLE = re.compile(r"^(_epoll\.poll|select|poll|sleep|Event\.wait|Condition\.wait) ")
_NOISE = re.compile(
    r"(click/|<frozen runpy>|celery/bin/|celery/__main__|bootsteps\.py|billiard/process\.py|"
    r"billiard/popen_fork|billiard/context|Pool\.__init__|_create_worker_process|TaskPool\.on_start|"
    r"BasePool\.start|Worker\.__call__|Worker\.workloop|WorkController\.start)"
)
# Where a sample's own frame lives, first match wins.
_BUCKETS = (
    ("waiting on PostgreSQL (psycopg wait)", re.compile(r"^(Connection\.wait|wait_c) \(psycopg")),
    ("billiard (parent <-> pool IPC)", re.compile(r"\(billiard/")),
    ("psycopg client work", re.compile(r"\(psycopg")),
    (
        "broker socket I/O",
        re.compile(r"(send_packed_command|_read_from_socket|sendall|recv|_write|_read) \("),
    ),
    ("redis-py client", re.compile(r"\(redis/")),
    ("amqp client", re.compile(r"\((amqp|librabbitmq)/")),
    ("kombu", re.compile(r"\((kombu|vine)/")),
    ("Celery", re.compile(r"\(celery/")),
    ("outbox_celery", re.compile(r"\(outbox_celery/")),
    ("json / pickle", re.compile(r"\((stdlib/)?(json|pickle)")),
    ("logging", re.compile(r"\(stdlib/logging")),
)


def _py_spy() -> str | None:
    candidate = Path(sys.executable).with_name("py-spy")
    return str(candidate) if candidate.exists() else shutil.which("py-spy")


def _norm(frame: str) -> str:
    frame = re.sub(r":\d+\)$", ")", frame)
    frame = re.sub(r"\(/[^()]*?site-packages/", "(", frame)
    frame = re.sub(r"\(/[^()]*?/lib/python3\.\d+/", "(stdlib/", frame)
    frame = re.sub(r"\(/[^()]*?/(outbox_celery|benchmarks)/", r"(\1/", frame)
    return frame


def _bucket(frame: str) -> str:
    for name, pattern in _BUCKETS:
        if pattern.search(frame):
            return name
    return "other"


@dataclass
class Summary:
    """One kind of process's profile."""

    role: str
    busy_samples: int
    idle_samples: int
    buckets: list[tuple[str, float]] = field(default_factory=list)
    self_top: list[tuple[str, float]] = field(default_factory=list)
    inclusive_top: list[tuple[str, float]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "role": self.role,
            "busy_samples": self.busy_samples,
            "idle_samples": self.idle_samples,
            "buckets": self.buckets,
            "self_top": self.self_top,
            "inclusive_top": self.inclusive_top,
        }


class _Tally:
    def __init__(self) -> None:
        self.busy = 0
        self.idle = 0
        self.self_counts: Counter[str] = Counter()
        self.incl: Counter[str] = Counter()
        self.buckets: Counter[str] = Counter()

    def summary(self, role: str, top: int) -> Summary:
        s = Summary(role, self.busy, self.idle)
        if self.busy:
            pct = 100 / self.busy
            s.buckets = [(b, round(c * pct, 1)) for b, c in self.buckets.most_common()]
            s.self_top = [(f, round(c * pct, 1)) for f, c in self.self_counts.most_common(top)]
            s.inclusive_top = [(f, round(c * pct, 1)) for f, c in self.incl.most_common(4 * top)]
        return s


def summarize(role: str, raw: Path, top: int = 15) -> list[Summary]:
    """Summarize a py-spy ``--format raw`` file: one summary per process kind.

    With ``--subprocesses`` a prefork worker's samples come from its main process (one
    ``process`` frame) and from its pool children (two); they are summarized apart.
    """
    tallies: dict[str, _Tally] = {}
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        parts = stack.split(";")
        depth = sum(1 for f in parts if f.startswith("process "))
        kind = role if depth <= 1 else f"{role} pool child"
        if depth <= 1 and role in ("deliver", "worker"):
            kind = f"{role} main process"
        tally = tallies.setdefault(kind, _Tally())
        frames = [_norm(f) for f in parts if not f.startswith("process ")]
        # A pool child blocked reading its next job from the parent is idle, not working.
        waiting_for_job = depth > 1 and any("_make_protected_receive" in f for f in frames[-6:])
        if not frames or _IDLE.match(frames[-1]) or waiting_for_job:
            tally.idle += count
            continue
        tally.busy += count
        tally.self_counts[frames[-1]] += count
        tally.buckets[_bucket(frames[-1])] += count
        for f in set(frames):
            if not _NOISE.search(f):
                tally.incl[f] += count
    return [t.summary(kind, top) for kind, t in sorted(tallies.items())]


class Profiler:
    """Attach py-spy to worker roles; :meth:`stop` ends the recordings and summarizes them."""

    def __init__(self, outdir: Path, rate: int = 100) -> None:
        self.outdir = outdir
        self.rate = rate
        self.spies: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
        self.exe = _py_spy()

    @property
    def available(self) -> bool:
        """Whether py-spy is installed."""
        return self.exe is not None

    def attach(self, roles: dict[str, Any]) -> None:
        """Start one ``py-spy record`` per role in ``("deliver", "claim")`` (or ``worker``)."""
        assert self.exe is not None
        for role in [r for r in ("deliver", "claim", "worker") if r in roles]:
            proc = roles[role]
            out = self.outdir / f"profile-{role}.raw.txt"
            spy = subprocess.Popen(
                [
                    self.exe,
                    "record",
                    "--pid",
                    str(proc.pid),
                    "--subprocesses",
                    "--nonblocking",
                    "--rate",
                    str(self.rate),
                    "--format",
                    "raw",
                    "--output",
                    str(out),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            self.spies[role] = (spy, out)

    def stop(self) -> list[Summary]:
        """Stop recording (SIGINT makes py-spy write its file) and summarize."""
        summaries = []
        for role, (spy, out) in self.spies.items():
            if spy.poll() is None:
                spy.send_signal(signal.SIGINT)
            try:
                spy.wait(30)
            except subprocess.TimeoutExpired:
                spy.kill()
                spy.wait(5)
            with contextlib.suppress(OSError):
                summaries.extend(summarize(role, out))
        return summaries
