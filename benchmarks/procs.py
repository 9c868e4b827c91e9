"""Child processes of a benchmark: each in its own process group, always stopped.

:class:`Processes` is a context manager; whatever happens inside it, every process group it
started is sent SIGTERM, given a grace period, then SIGKILL, so nothing is left behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import psutil

__all__ = ["Proc", "Processes", "celery_command"]

ROOT = Path(__file__).resolve().parent.parent


class Proc:
    """One started child (the leader of its own process group)."""

    def __init__(self, name: str, popen: subprocess.Popen[bytes], log: Path) -> None:
        self.name = name
        self.popen = popen
        self.log = log

    @property
    def pid(self) -> int:
        """The leader's pid."""
        return self.popen.pid

    def tree(self) -> list[psutil.Process]:
        """The leader and its live descendants."""
        try:
            leader = psutil.Process(self.pid)
            return [leader, *leader.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def alive(self) -> bool:
        """Whether the leader is still running."""
        return self.popen.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the group, wait up to ``grace`` seconds, then SIGKILL the group."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(grace)
        # The group may outlive its leader (pool children): always sweep it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)

    def tail(self, lines: int = 20) -> str:
        """The end of the process's log, for error messages."""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class Processes:
    """Start children with :meth:`start`; all are stopped when the block exits."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: list[Proc] = []

    def start(self, name: str, args: Sequence[str], env: dict[str, str]) -> Proc:
        """Start ``args`` with ``env`` added to this process's environment; log to ``<name>.log``."""
        log = self.logdir / f"{name}.log"
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                list(args),
                env=full_env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        """Stop every child, newest first."""
        while self.procs:
            self.procs.pop().stop()

    def __enter__(self) -> Processes:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop_all()


def celery_command(app: str, *args: str) -> list[str]:
    """``python -m celery -A <app> <args>`` with this interpreter."""
    return [sys.executable, "-m", "celery", "-A", app, *args]


def wait_for(path: Path, procs: Sequence[Proc], timeout: float) -> None:
    """Wait until ``path`` exists; fail early with a log tail if a process died."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        for p in procs:
            if not p.alive():
                raise RuntimeError(f"{p.name} exited early:\n{p.tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} did not appear within {timeout}s")
        time.sleep(0.05)
