"""The Procfile and docker-compose.yml describe one stack, and every command in them exists.

There is no Docker engine here: the compose file is checked as data (it parses, its services
are wired with healthchecks and ``depends_on`` conditions, its commands resolve to importable
modules, Celery apps and queues) and against the Procfile, process by process. The Procfile
itself is run for real under honcho against the test database and broker.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
import psycopg
import pytest
import yaml
from celery import Celery
from honcho.environ import parse_procfile
from support.brokers import fresh_redis_db

from outbox_celery.testing import free_port

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the examples package lives at the repository root, not installed
    sys.path.insert(0, str(ROOT))
COMPOSE = ROOT / "docker-compose.yml"
PROCFILE = ROOT / "Procfile"
APP_SERVICES = {
    "receiver",
    "api",
    "worker-claim",
    "worker-webhooks",
    "worker-fulfilment",
    "beat",
    "flower",
}
# Options that only say where a process listens: they differ between containers and a laptop.
PLACEMENT = {"--host", "--address"}
_DEFAULTED = re.compile(r"\$\{(\w+):-([^}]*)\}")


def _compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def _procfile() -> dict[str, str]:
    return dict(parse_procfile(PROCFILE.read_text()).processes)


def _argv(command: str | list[str]) -> list[str]:
    """A command as argv, with ``${VAR:-default}`` resolved to its default."""
    if isinstance(command, list):
        return [str(c) for c in command]
    return shlex.split(_DEFAULTED.sub(lambda m: m.group(2), command))


def _normalized(argv: list[str]) -> list[str]:
    """``argv`` without placement options (``--host 0.0.0.0``), ``--opt=value`` split."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name, eq, value = arg.partition("=")
        if name in PLACEMENT:
            skip = not eq
            continue
        out.extend([name, value] if eq and name.startswith("--") else [arg])
    return out


def _option(argv: list[str], *names: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg in names and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _celery_app(target: str) -> Celery:
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    app = getattr(module, attr or "app", None) or getattr(module, "celery", None)
    assert isinstance(app, Celery), f"{target} has no Celery app"
    return app


def _check_command(argv: list[str], scripts: set[str]) -> None:
    """The command starts something that exists in the package or the examples."""
    program = argv[0]
    if program == "python":
        assert argv[1] == "-m", argv
        assert importlib.util.find_spec(argv[2]) is not None, f"no module {argv[2]}"
        module = importlib.import_module(argv[2])
        assert callable(getattr(module, "main", None)), f"{argv[2]} has no main()"
    elif program == "celery":
        assert argv[1] == "-A", argv
        app = _celery_app(argv[2])
        sub = argv[3]
        assert sub in {"worker", "beat", "flower", "inspect"}, argv
        if sub == "flower":
            assert importlib.util.find_spec("flower") is not None
        if sub == "worker":
            from examples.orders.app import outbox

            assert outbox.app is app
            queues = set((_option(argv, "-Q", "--queues") or "").split(","))
            assert queues and queues <= set(outbox.queues), (queues, outbox.queues)
    else:
        assert program in scripts, f"{program} is neither python -m, celery, nor a console script"


def _scripts() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project.get("scripts", {}))


def test_compose_file_parses_and_wires_the_stack() -> None:
    services = _compose()["services"]
    assert set(services) == {"postgres", "redis", "migrate"} | APP_SERVICES

    assert str(services["postgres"]["image"]).startswith("postgres:18")
    assert str(services["redis"]["image"]).startswith("redis:")
    for name in ("postgres", "redis", "receiver", "api", "flower"):
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has no healthcheck"

    # The one-shot migration runs once PostgreSQL is healthy and is not restarted.
    migrate = services["migrate"]
    assert str(migrate.get("restart", "no")) == "no"
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"

    conditions = {"service_healthy", "service_completed_successfully", "service_started"}
    for name, service in services.items():
        for dep, spec in (service.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            condition = spec["condition"]
            assert condition in conditions, (name, dep, condition)
            if condition == "service_healthy":
                assert services[dep].get("healthcheck"), f"{name} waits for {dep}'s health, it has none"
            if dep == "migrate":
                assert condition == "service_completed_successfully", name

    # Whatever touches the outbox tables starts after the migration.
    for name in ("api", "worker-claim", "worker-webhooks", "worker-fulfilment", "beat"):
        assert "migrate" in services[name]["depends_on"], name
    for name in ("worker-claim", "worker-webhooks", "worker-fulfilment", "beat", "flower"):
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy", name

    # Every app service is built from the example Dockerfile, which copies what they run.
    dockerfile = None
    for name in APP_SERVICES | {"migrate"}:
        build = services[name]["build"]
        assert build["context"] == "."
        dockerfile = ROOT / build["dockerfile"]
        assert dockerfile.is_file()
    assert dockerfile is not None
    text = dockerfile.read_text()
    for copied in ("pyproject.toml", "outbox_celery", "examples"):
        assert re.search(rf"^COPY .*\b{copied}\b", text, re.M), copied
    assert "flower" in text


def test_compose_and_procfile_commands_exist() -> None:
    scripts = _scripts()
    for service in _compose()["services"].values():
        if "command" in service:
            _check_command(_argv(service["command"]), scripts)
        for test in [service.get("healthcheck", {}).get("test") or []]:
            if test[:1] == ["CMD-SHELL"] and "celery" in test[1]:
                _check_command(_argv(test[1].replace("$$", "$")), scripts | {"celery"})
    for command in _procfile().values():
        _check_command(_argv(command), scripts)


def test_procfile_and_compose_describe_the_same_processes() -> None:
    services = _compose()["services"]
    procfile = _procfile()
    assert set(procfile) == APP_SERVICES
    for name, command in procfile.items():
        local = _normalized(_argv(command))
        container = _normalized(_argv(services[name]["command"]))
        assert local == container, f"{name}:\n  Procfile: {local}\n  compose:  {container}"


def test_every_queue_has_a_worker_in_both_files() -> None:
    from examples.orders.app import outbox

    expected = set(outbox.queues)
    assert len({outbox.queue_for(t) for t in outbox.handlers}) >= 2, "event types use one queue only"
    compose = [_argv(s["command"]) for s in _compose()["services"].values() if "command" in s]
    procfile = [_argv(c) for c in _procfile().values()]
    for commands in (compose, procfile):
        consumed = set()
        for argv in commands:
            if argv[:1] == ["celery"] and argv[3] == "worker":
                consumed |= set((_option(argv, "-Q") or "").split(","))
        assert consumed == expected
    beats = [a for a in compose + procfile if a[:1] == ["celery"] and a[3] == "beat"]
    assert len(beats) == 2, "exactly one beat in each file"


def test_ports_and_environment_agree() -> None:
    from examples.orders import settings

    services = _compose()["services"]
    env = services["api"]["environment"]
    for name in APP_SERVICES | {"migrate"}:
        assert services[name]["environment"] == env, f"{name} has a different environment"
    assert set(env) >= {"OUTBOX_DSN", "CELERY_BROKER_URL", "WEBHOOK_URL"}
    # The services' ports are the defaults the Procfile relies on.
    assert int(env["API_PORT"]) == settings.DEFAULT_API_PORT
    assert int(env["RECEIVER_PORT"]) == settings.DEFAULT_RECEIVER_PORT
    assert services["api"]["ports"] == [f"{env['API_PORT']}:{env['API_PORT']}"]
    assert services["receiver"]["ports"] == [f"{env['RECEIVER_PORT']}:{env['RECEIVER_PORT']}"]
    assert services["flower"]["ports"] == ["5555:5555"]
    # Handlers reach the receiver by its service name and port.
    webhook = urlsplit(env["WEBHOOK_URL"])
    assert (webhook.hostname, webhook.port, webhook.path) == (
        "receiver",
        int(env["RECEIVER_PORT"]),
        "/webhooks",
    )
    # The DSN and broker point at the compose services.
    assert urlsplit(env["OUTBOX_DSN"]).hostname == "postgres"
    assert urlsplit(env["CELERY_BROKER_URL"]).hostname == "redis"
    # Flower: 5555 in both files.
    flower_local = _normalized(_argv(_procfile()["flower"]))
    assert _option(flower_local, "--port") == "5555"
    # The healthchecks probe the ports the services listen on.
    assert env["RECEIVER_PORT"] in " ".join(services["receiver"]["healthcheck"]["test"])
    assert env["API_PORT"] in " ".join(services["api"]["healthcheck"]["test"])
    assert "5555" in " ".join(services["flower"]["healthcheck"]["test"])


def _get_json(url: str) -> Any:
    import json

    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _post(url: str, body: dict[str, Any] | None = None) -> Any:
    import json

    request = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=10) as r:
        return json.loads(r.read())


def _wait(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except OSError:
            value = None
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def honcho(dsn: str, redis_url: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """``honcho start`` on the Procfile, after the schema step, against the test services."""
    bindir = str(Path(sys.executable).parent)
    ports = {"API_PORT": free_port(), "RECEIVER_PORT": free_port(), "FLOWER_PORT": free_port()}
    env = {k: v for k, v in os.environ.items() if k not in ("WEBHOOK_URL", "RECEIVER_DSN")}
    env.update({k: str(v) for k, v in ports.items()})
    env.update(
        OUTBOX_DSN=dsn,
        CELERY_BROKER_URL=fresh_redis_db(redis_url, 13),
        CELERY_BEAT_SCHEDULE=str(tmp_path / "celerybeat-schedule"),
        # `python` and `celery` in the Procfile are this environment's.
        PATH=os.pathsep.join([bindir, env.get("PATH", "")]),
        PYTHONUNBUFFERED="1",
    )
    subprocess.run([sys.executable, "-m", "examples.orders.migrate"], env=env, cwd=ROOT, check=True)
    log = (tmp_path / "honcho.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "honcho", "start", "-f", str(PROCFILE), "-d", str(ROOT)],
        env=env,
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    seen: dict[int, float] = {}
    info = {"proc": proc, "ports": ports, "seen": seen, "log": tmp_path / "honcho.log"}
    try:
        yield info
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        log.close()
        for pid, started in seen.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == started:
                    os.killpg(pid, signal.SIGKILL)
            except (psutil.NoSuchProcess, ProcessLookupError, PermissionError):
                continue


@pytest.mark.slow
def test_procfile_runs_the_stack_under_honcho(honcho: dict[str, Any], dsn: str) -> None:
    proc: subprocess.Popen[bytes] = honcho["proc"]
    ports = honcho["ports"]
    seen: dict[int, float] = honcho["seen"]
    api = f"http://127.0.0.1:{ports['API_PORT']}"

    def log() -> str:
        return Path(honcho["log"]).read_text(errors="replace")

    def healthy() -> bool:
        assert proc.poll() is None, log()
        for url in (
            f"{api}/health",
            f"http://127.0.0.1:{ports['RECEIVER_PORT']}/health",
            f"http://127.0.0.1:{ports['FLOWER_PORT']}/healthcheck",
        ):
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status != 200:
                    return False
        return True

    _wait(healthy, 120, "the Procfile's HTTP services")
    for child in psutil.Process(proc.pid).children(recursive=True):
        seen.setdefault(child.pid, child.create_time())
    order = _post(f"{api}/orders", {"customer": "honcho", "total_cents": 1234})["id"]
    _post(f"{api}/orders/{order}/pay")
    _post(f"{api}/orders/{order}/ship")

    def delivered() -> bool:
        assert proc.poll() is None, log()
        events = _get_json(f"{api}/orders/{order}")["events"]
        # 6 events, order.paid to its two subscriptions (webhook and receipt): 7 rows.
        return len(events) == 7 and all(e["status"] == "done" for e in events)

    _wait(delivered, 120, f"order {order}'s events to be delivered\n{log()}")
    with psycopg.connect(dsn, autocommit=True) as conn:
        keys = conn.execute(
            "SELECT count(*) FROM receiver.webhook_inbox WHERE idempotency_key IN"
            " (SELECT idempotency_key FROM receiver.requests WHERE order_id = %s)",
            [order],
        ).fetchone()
        assert keys == (6,)
    for child in psutil.Process(proc.pid).children(recursive=True):
        seen.setdefault(child.pid, child.create_time())
    names = set()
    for pid in seen:
        with contextlib.suppress(psutil.NoSuchProcess):
            names.add(" ".join(psutil.Process(pid).cmdline()))
    for expected in ("examples.orders.receiver", "examples.orders.api", "outbox.claim", "beat", "flower"):
        assert any(expected in n for n in names), (expected, names)

    # honcho stops every process on SIGTERM (what Ctrl-C does to it too).
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    left = []
    for pid, started in seen.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                left.append((pid, p.cmdline()))
        except psutil.NoSuchProcess:
            continue
    assert not left, left
