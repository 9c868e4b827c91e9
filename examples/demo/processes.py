"""Start the stack's processes and stop every one of them, whatever happens.

Each child runs in its own session (a new process group), so a terminal's Ctrl-C reaches only
the demo, which then stops its children in order: ``SIGTERM`` to each group leader (Celery's
warm shutdown, the HTTP servers' clean stop), a grace period, then ``SIGKILL`` to every
process group so that nothing (Celery pool children included) outlives the demo.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Child", "ChildExitedError", "Supervisor"]


class ChildExitedError(RuntimeError):
    """A process of the stack exited while it should be running."""

    def __init__(self, child: Child) -> None:
        super().__init__(f"{child.name} exited with code {child.popen.returncode}")
        self.child = child


@dataclass(slots=True)
class Child:
    """One started process."""

    name: str
    argv: list[str]
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        """The group leader's pid (also the process group id)."""
        return self.popen.pid

    def tail(self, lines: int = 25) -> str:
        """The end of its log."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - someone else's group reusing the id
        return False
    return True


class Supervisor:
    """The demo's children: started with logs in ``log_dir``, stopped in :meth:`stop_all`.

    :param env: the environment of every child.
    :param cwd: their working directory (the repository root, so ``-m examples...`` imports).
    :param guard: a context manager factory held around each start (the demo holds Ctrl-C
        there, so that no child is started without being recorded).
    """

    def __init__(
        self,
        log_dir: Path,
        *,
        env: Mapping[str, str],
        cwd: Path,
        guard: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext,
    ) -> None:
        self.log_dir = log_dir
        self.env = dict(env)
        self.cwd = cwd
        self.guard = guard
        self.children: list[Child] = []
        self.hurry = False
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, argv: list[str]) -> Child:
        """Start ``argv`` in a new session, output appended to ``<log_dir>/<name>.log``."""
        path = self.log_dir / f"{name}.log"
        with self.guard(), path.open("ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv)}\n".encode())
            log.flush()
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
            child = Child(name, argv, popen, path)
            self.children.append(child)
        return child

    def check(self) -> None:
        """Raise :class:`ChildExitedError` if a child is gone."""
        for child in self.children:
            if child.popen.poll() is not None:
                raise ChildExitedError(child)

    @property
    def pids(self) -> dict[str, int]:
        """Name -> pid of every child started."""
        return {c.name: c.pid for c in self.children}

    def stop(self, children: Iterable[Child], *, grace: float = 15.0) -> None:
        """``SIGTERM`` the group leaders, wait up to ``grace`` seconds, then ``SIGKILL`` the groups."""
        group = list(children)
        for child in group:
            if child.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and not self.hurry:
            if all(c.popen.poll() is not None for c in group):
                break
            time.sleep(0.1)
        for child in group:
            # Stragglers in the group too (a Celery pool child whose parent was killed).
            if _group_alive(child.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILL cannot be ignored
                child.popen.wait(timeout=5)

    def stop_all(self, order: Iterable[Iterable[str]] = ()) -> None:
        """Stop every child: the named groups first (each group in parallel), then the rest."""
        remaining = list(self.children)
        for names in order:
            wanted = set(names)
            batch = [c for c in remaining if c.name in wanted]
            remaining = [c for c in remaining if c.name not in wanted]
            if batch:
                self.stop(batch)
        if remaining:
            self.stop(remaining)

    def survivors(self) -> list[str]:
        """Names of children whose process group still has a live process."""
        return [c.name for c in self.children if _group_alive(c.pid)]
