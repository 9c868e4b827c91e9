"""examples/django_shop/README.md, followed as written: real manage.py, worker, beat, runserver.

Every ``$`` line of the README's console blocks runs in a shell, in order, from the repository
root: ``cd`` changes the directory, ``export`` sets the variable (the test's own database and
broker replace the README's values), a line ending in ``&`` starts a background process (stopped
at the end). The only edits: the runserver port 8000 becomes a free port, and runserver starts
a few seconds late, as on a loaded machine, so the README itself must wait for the server before
its ``curl``. Then the admin fixes the dead event over HTTP, as the README's last section
says.
"""

from __future__ import annotations

import http.cookiejar
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from support.processes import REPO_ROOT, wait_until

from outbox_celery.testing import free_port

pytest.importorskip("django")

pytestmark = pytest.mark.slow

README = REPO_ROOT / "examples" / "django_shop" / "README.md"
SETTLE = 90.0
# How late runserver starts: a loaded machine's import of Django and the project.
SLOW_START = 3.0


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def commands(block: str) -> list[str]:
    return [line[2:] for line in block.splitlines() if line.startswith("$ ")]


class Shell:
    """Runs README lines: foreground ones to completion, ``&`` ones in their own session."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.cwd = REPO_ROOT
        self.env = env
        self.logs = logs
        self.background: list[tuple[subprocess.Popen[bytes], Path]] = []

    def run(self, line: str, overrides: dict[str, str]) -> str:
        if line.startswith("cd "):
            self.cwd = (self.cwd / line[3:].strip()).resolve()
            return ""
        if line.startswith("export "):
            name, _, value = line[len("export ") :].partition("=")
            self.env[name] = overrides.get(name, value)
            return ""
        if line.endswith("&"):
            log = self.logs / f"bg{len(self.background)}.log"
            with log.open("wb") as out:
                popen = subprocess.Popen(
                    line[:-1],
                    shell=True,
                    cwd=self.cwd,
                    env=self.env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self.background.append((popen, log))
            return ""
        done = subprocess.run(
            line,
            shell=True,
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, (
            f"{line!r} exited {done.returncode}:\n{done.stdout}\n{done.stderr}\n{self.tail()}"
        )
        return done.stdout

    def tail(self) -> str:
        return "\n".join(
            f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for _, log in self.background
        )

    def stop(self) -> None:
        for popen, _ in self.background:
            if popen.poll() is None:
                os.killpg(popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for popen, _ in self.background:
            try:
                popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(popen.pid, signal.SIGKILL)
                popen.wait()


@pytest.fixture
def shell(tmp_path: Path) -> Iterator[Shell]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["SHOP_BEAT_SCHEDULE"] = str(tmp_path / "beat-schedule")
    env.pop("DJANGO_SETTINGS_MODULE", None)
    s = Shell(env, tmp_path)
    try:
        yield s
    finally:
        s.stop()


class Browser:
    """A logged-in admin session over HTTP (cookies and CSRF like a browser)."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))

    def get(self, path: str) -> str:
        with self.opener.open(self.base + path, timeout=30) as r:
            return str(r.read().decode())

    def post(self, path: str, data: dict[str, Any]) -> str:
        csrf = next(c.value for c in self.jar if c.name == "csrftoken")
        body = urllib.parse.urlencode({**data, "csrfmiddlewaretoken": csrf}, doseq=True).encode()
        request = urllib.request.Request(self.base + path, data=body, headers={"Referer": self.base + path})
        with self.opener.open(request, timeout=30) as r:
            return str(r.read().decode())

    def login(self, user: str, password: str) -> None:
        self.get("/admin/login/")
        page = self.post(
            "/admin/login/?next=/admin/", {"username": user, "password": password, "next": "/admin/"}
        )
        assert "Log out" in page or "logout" in page, page[:2000]


def _orders(dsn: str) -> dict[int, tuple[bool, str]]:
    with psycopg.connect(dsn) as c:
        rows = c.execute(
            "SELECT o.id, o.confirmation_sent_at IS NOT NULL, e.status FROM orders_order o"
            " JOIN outbox e ON e.event_type = 'order.placed' AND (e.payload->>'order_id')::bigint = o.id"
        ).fetchall()
    return {int(r[0]): (bool(r[1]), str(r[2])) for r in rows}


def test_the_django_shop_readme_works_as_written(shell: Shell, dsn: str, redis_url: str) -> None:
    text = README.read_text()
    run_block, expected_block = blocks(text, "console")[0], blocks(text, "text")[0]
    port = free_port()
    overrides = {"SHOP_DSN": dsn, "CELERY_BROKER_URL": redis_url}
    first = {1: (True, "done"), 2: (True, "done"), 3: (False, "dead"), 4: (False, "pending")}
    for line in commands(run_block):
        line = line.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        if "manage.py runserver" in line:
            line = f"sleep {SLOW_START:g} && {line}"
        if line.endswith("orders_status"):
            wait_until(lambda: _orders(dsn) == first, SETTLE, lambda: f"{_orders(dsn)}\n{shell.tail()}")
        out = shell.run(line, overrides)
        if line.startswith("curl ") and "-X POST" in line:
            assert '"order_id": 2' in out
    assert out.splitlines() == expected_block.strip().splitlines()

    # "Fix it in the admin": create the superuser, log in, see the dead head, skip it.
    for line in commands(blocks(text, "console")[1]):
        shell.run(line, overrides)
    password = re.search(r"DJANGO_SUPERUSER_PASSWORD=(\S+)", text)
    assert password is not None
    admin = Browser(f"http://127.0.0.1:{port}")
    admin.login("admin", password.group(1))
    changelist = "/admin/outbox_celery/outboxmessage/"
    page = admin.get(changelist)
    assert "dead 1" in page and "1 ordering key(s) blocked" in page and "1 waiting" in page
    dead = re.findall(r'name="_selected_action" value="(\d+)"', admin.get(changelist + "?status=dead"))
    assert len(dead) == 1
    assert "order 3 has a total of 0" in admin.get(f"{changelist}{dead[0]}/change/")
    page = admin.post(
        changelist,
        {"action": "skip_messages", "_selected_action": dead, "confirm": "yes", "reason": "order cancelled"},
    )
    assert "Skipped 1 message(s)" in page
    wait_until(
        lambda: _orders(dsn) == {1: (True, "done"), 2: (True, "done"), 3: (False, "done"), 4: (True, "done")},
        SETTLE,
        lambda: f"{_orders(dsn)}\n{shell.tail()}",
    )
