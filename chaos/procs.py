"""Child processes of a chaos run: each in its own session, tracked, always stopped.

Every child (Celery worker or beat, redis-server, pgbouncer) is the leader of a new process
group, so a SIGKILL of the group also takes a Celery worker's prefork children with it, and
:meth:`Supervisor.stop_all` leaves nothing behind whatever happened during the run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Child", "Supervisor", "child_pids", "group_alive"]


def group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is still running (and ours to signal)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid``, read from /proc (a Celery worker's prefork pool processes)."""
    children: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces, so split after the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            children.append(int(entry.name))
    return sorted(children)


@dataclass
class Child:
    """One started process (the leader of its own process group)."""

    name: str
    argv: list[str]
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        """The leader's pid, which is also the process group id."""
        return self.popen.pid

    def alive(self) -> bool:
        """Whether the leader is still running."""
        return self.popen.poll() is None

    def text(self) -> str:
        """Everything the process logged so far."""
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 25) -> str:
        """The end of its log, for error messages."""
        return "\n".join(self.text().splitlines()[-lines:])

    def wait_for_log(self, text: str, timeout: float, *, after: int = 0) -> None:
        """Wait until ``text`` appears in the log past byte ``after``; fail if the process dies."""
        deadline = time.monotonic() + timeout
        while text not in self.text()[after:]:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited ({self.popen.returncode}):\n{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not log {text!r} within {timeout}s:\n{self.tail()}")
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL the whole group (no warm shutdown) and reap the leader."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)

    def terminate(self) -> None:
        """SIGTERM the leader (Celery's warm shutdown) without waiting."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the leader, wait up to ``grace`` seconds, then SIGKILL what is left of the group."""
        self.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(grace)
        # Pool children can outlive their leader: always sweep the group.
        if group_alive(self.pid):
            self.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)


class Supervisor:
    """Starts children with logs in ``log_dir``; :meth:`stop_all` stops every one, newest first."""

    def __init__(self, log_dir: Path, env: Mapping[str, str], cwd: Path) -> None:
        self.log_dir = log_dir
        self.env = dict(env)
        self.cwd = cwd
        self.children: list[Child] = []
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None) -> Child:
        """Start ``argv`` in a new session; output appended to ``<log_dir>/<name>.log``."""
        path = self.log_dir / f"{name}.log"
        with path.open("ab") as log:
            log.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(argv)}\n".encode())
            log.flush()
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**self.env, **(env or {})},
                cwd=self.cwd,
                start_new_session=True,
            )
        child = Child(name, list(argv), popen, path)
        self.children.append(child)
        return child

    def forget(self, child: Child) -> None:
        """Stop tracking a child that was stopped or killed on purpose."""
        with contextlib.suppress(ValueError):
            self.children.remove(child)

    def stop_all(self) -> None:
        """Stop every child still tracked, newest first."""
        while self.children:
            self.children.pop().stop(grace=5.0)
