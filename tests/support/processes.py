"""Start real ``celery worker`` and ``celery beat`` subprocesses and always clean them up.

Each process runs in its own session (so its process group holds the prefork pool children
too): :meth:`CeleryProcess.stop` asks for a warm shutdown, waits, then SIGKILLs the whole
group; :meth:`CeleryProcess.kill` SIGKILLs it at once. :class:`CeleryProcesses` tracks every
process it started and stops them all in :meth:`~CeleryProcesses.close` (a fixture's teardown),
so a failing test leaves no orphans behind.

Output (stdout and stderr) goes to one log file per process, which tests read to wait for
readiness and to look for lines such as ``lost lease``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from chaos.procs import child_pids, group_alive

# tests/ (holding the ``support`` package) and the repository root, found at run time.
TESTS_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = TESTS_DIR.parent
APP_MODULE = "support.worker_app"


@dataclass
class CeleryProcess:
    """One ``celery worker`` or ``celery beat`` subprocess."""

    kind: str
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    _log_file: object = field(repr=False, default=None)

    @property
    def pid(self) -> int:
        """The main process id (also its process group id)."""
        return self.popen.pid

    def alive(self) -> bool:
        """Whether the main process is still running."""
        return self.popen.poll() is None

    def log(self) -> str:
        """Everything the process wrote so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_for_log(self, text: str, timeout: float = 30.0, *, count: int = 1) -> str:
        """Wait until ``text`` appears ``count`` times in the log; fail if the process dies first."""
        deadline = time.monotonic() + timeout
        while True:
            content = self.log()
            if content.count(text) >= count:
                return content
            if not self.alive():
                raise AssertionError(
                    f"{self.kind} {self.name} exited ({self.popen.returncode}) before logging {text!r}:\n"
                    + content[-4000:]
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{self.kind} {self.name} did not log {text!r} within {timeout}s:\n" + content[-4000:]
                )
            time.sleep(0.05)

    def wait_ready(self, timeout: float = 45.0) -> None:
        """Wait until the worker is consuming (``ready.``) or beat has started."""
        self.wait_for_log("ready." if self.kind == "worker" else "beat: Starting...", timeout)

    def pool_pids(self) -> list[int]:
        """The prefork pool's child processes (empty for solo)."""
        return child_pids(self.pid)

    def pause(self) -> None:
        """SIGSTOP the whole process group."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the whole process group."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the whole process group and reap the main process."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)
        self._close_log()

    def terminate(self) -> None:
        """Ask for a warm shutdown (SIGTERM to the main process) without waiting."""
        self.resume()
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)

    def stop(self, timeout: float = 15.0) -> int | None:
        """Warm shutdown (SIGTERM), then SIGKILL whatever is left of the group."""
        self.terminate()
        return self.reap(timeout)

    def reap(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` for the process to exit, then SIGKILL what is left of the group."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=max(timeout, 0.0))
        # Pool children that outlived their parent, or a parent that ignored SIGTERM.
        if self.alive() or group_alive(self.pid):
            self.kill()
        self._close_log()
        return self.popen.returncode

    def _close_log(self) -> None:
        f = self._log_file
        if f is not None and hasattr(f, "close"):
            f.close()
        self._log_file = None


class CeleryProcesses:
    """Starts worker and beat processes for one test and stops every one of them at the end.

    :param log_dir: where log files (and beat's schedule and pid files) go.
    :param env: environment of every process (on top of this process's), e.g. an app spec.
    :param app_module: the ``celery -A`` module (default: the acceptance tests' app).
    """

    def __init__(
        self, log_dir: Path, env: Mapping[str, str] | None = None, *, app_module: str = APP_MODULE
    ) -> None:
        self.app_module = app_module
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = dict(env or {})
        self.started: list[CeleryProcess] = []
        self._n = 0

    def _environ(self, extra: Mapping[str, str] | None) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.env)
        env.update(extra or {})
        path = [str(TESTS_DIR), str(REPO_ROOT)]
        if env.get("PYTHONPATH"):
            path.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(path)
        env["PYTHONUNBUFFERED"] = "1"
        # A broker URL from the caller's shell must not override the app's own.
        for key in ("CELERY_BROKER_URL", "CELERY_BROKER_READ_URL", "CELERY_BROKER_WRITE_URL"):
            env.pop(key, None)
        return env

    def _spawn(
        self, kind: str, name: str, args: Sequence[str], env: Mapping[str, str] | None
    ) -> CeleryProcess:
        self._n += 1
        log_path = self.log_dir / f"{self._n:02d}-{kind}-{name}.log"
        log_file = open(log_path, "wb")  # noqa: SIM115 - closed by CeleryProcess
        cmd = [sys.executable, "-m", "celery", "-A", self.app_module, *args]
        popen = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            env=self._environ(env),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        proc = CeleryProcess(kind, name, popen, log_path, log_file)
        self.started.append(proc)
        return proc

    def worker(
        self,
        queues: Iterable[str],
        *,
        name: str = "w1",
        concurrency: int | None = None,
        pool: str = "prefork",
        env: Mapping[str, str] | None = None,
        loglevel: str = "INFO",
        extra_args: Sequence[str] = (),
        wait: bool = True,
    ) -> CeleryProcess:
        """Start ``celery worker`` consuming ``queues``; by default wait until it is ready.

        ``concurrency`` defaults to 1 for the solo pool (Celery would otherwise size its prefetch
        by the CPU count although solo runs one task at a time) and 2 for the others.
        """
        args = [
            "worker",
            "-l",
            loglevel,
            "-Q",
            ",".join(queues),
            "-P",
            pool,
            "-n",
            f"{name}@%h",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
        args += ["-c", str(concurrency or (1 if pool == "solo" else 2))]
        proc = self._spawn("worker", name, [*args, *extra_args], env)
        if wait:
            proc.wait_ready()
        return proc

    def beat(
        self, *, name: str = "beat", env: Mapping[str, str] | None = None, wait: bool = True
    ) -> CeleryProcess:
        """Start ``celery beat`` with a private schedule file; by default wait until it started."""
        args = [
            "beat",
            "-l",
            "INFO",
            "-s",
            str(self.log_dir / f"{name}-schedule"),
            "--pidfile",
            str(self.log_dir / f"{name}.pid"),
            "--max-interval",
            "1",
        ]
        proc = self._spawn("beat", name, args, env)
        if wait:
            proc.wait_ready()
        return proc

    def close(self, timeout: float = 5.0) -> None:
        """Stop every process started here: all warm at once, then SIGKILL what is left."""
        errors: list[BaseException] = []
        for proc in reversed(self.started):
            try:
                proc.terminate()
            except BaseException as exc:  # pragma: no cover - keep stopping the others
                errors.append(exc)
        deadline = time.monotonic() + timeout
        for proc in reversed(self.started):
            try:
                proc.reap(deadline - time.monotonic())
            except BaseException as exc:  # pragma: no cover - keep stopping the others
                errors.append(exc)
        if errors:
            raise errors[0]

    def logs(self) -> str:
        """Every process's log, for failure messages."""
        return "\n".join(f"===== {p.kind} {p.name} =====\n{p.log()[-6000:]}" for p in self.started)


def wait_until(
    predicate: Callable[[], object], timeout: float, message: str | Callable[[], str] = "condition"
) -> object:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            text = message() if callable(message) else message
            raise AssertionError(f"timed out after {timeout}s waiting for: {text}")
        time.sleep(0.1)
