"""Every console command shown in README.md and docs/*.md is executed here, as written.

A command is a ``$ ...`` line of any fenced block, any line of a ``sh``/``bash``/``shell``
block, or a line of a plain block that starts with ``outbox-celery``, ``celery``, ``python -m``
or ``make`` (a listing of commands). Synopsis lines (``[OPTION]``, ``...``) are reported, not
run. Each document runs its commands in order in a shell, in a scratch directory holding the
project the README describes (``proj/outbox.py`` is the README's own Python block), against a
fresh database of the test server and the test broker. Only the placeholders below are
substituted (and printed); everything else runs verbatim:

* ``postgresql://app@localhost/app`` -> the fresh database, also in ``OUTBOX_DSN`` as the docs
  say the CLI reads it;
* ``redis://localhost:6379/0`` -> the test broker (never the shared Redis database 0).

A listed command that refers to data the fresh database does not hold (message ids, a
directory, a busy port) passes when the CLI refuses it the documented way (exit 1, one
``Error:`` line): it was parsed and understood; a usage error (exit 2) or a traceback fails.
Long-running servers (``celery worker``, ``celery beat``, ``outbox-celery metrics``) are run
bounded: started, required to print their banner and stay up for a few seconds, then stopped
with SIGTERM and required to exit cleanly. ``make`` targets that run for minutes are checked
with ``make -n`` (the target exists) and their ``*_ARGS`` are parsed by the program's own
argument parser; :data:`NOT_RUN` says why each is not run in full and the test prints it. A
documented command that fails, or a new one nobody classified, fails here.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from outbox_celery.testing import temporary_database

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCKS = {"sh", "bash", "shell"}
LISTING_BLOCKS = {"", "text"}
LISTED = {"outbox-celery", "celery", "make"}
DOC_DSN = "postgresql://app@localhost/app"
DOC_BROKER = "redis://localhost:6379/0"
TIMEOUT = 120.0  # seconds; bounds a hung command, never asserts speed
# The last line of each banner (their "ready" lines are INFO, below the default log level), and how
# long the process must then stay up: it has connected to the broker and imported the project.
READY = {
    "worker": "[queues]",
    "beat": ". maxinterval ->",
    "metrics": "serving metrics of",
    "web": "outbox console (",
}
STAY_UP = 5.0
REFUSED = "refused as documented (exit 1, one line): "

# What a document's prose (not a console block) tells the reader to do before its commands.
PREREQUISITES = {
    "docs/celery.md": ["outbox-celery migrate"],  # "Create the table once (`outbox-celery migrate`...)"
    # "Subscriptions are rows of the table `<outbox table>_subscription` (created by `migrate`, ...)"
    "docs/subscriptions.md": ["outbox-celery migrate"],
}

# Commands not run in full, each with the reason and what is checked instead (printed by the test).
NOT_RUN = {
    "make test": "runs this very suite (recursion); CI runs it. Checked: `make -n test`.",
    "make demo": "the whole stack for minutes; run end to end (bounded) by tests/acceptance/"
    "test_demo.py. Checked: `make -n demo` and DEMO_ARGS parsed by the demo's parser.",
    "make bench": "benchmarks for 1-8 minutes on a shared machine; figures belong in benchmarks/. "
    "Checked: `make -n bench` and BENCH_ARGS parsed by the benchmarks' parser.",
    "make chaos": "real workers under faults for 2-5 minutes; CI runs `make chaos CHAOS_ARGS=--short` "
    "itself. Checked: `make -n chaos` and CHAOS_ARGS parsed by the suite's parser.",
    "make dist": "docs/releasing.md: builds the sdist and wheel (rm -rf dist build first, in the "
    "checkout); tests/unit/test_release.py builds and checks the wheel. Checked: `make -n dist`.",
    "make dist-check": "docs/releasing.md: a clean virtualenv and a pip install from the index; "
    ".ci/run runs it. Checked: `make -n dist-check`.",
    "celery -A proj worker": "docs/django.md: a Django project's worker (its proj/celery.py); the "
    "same command runs against the Django example in tests/acceptance/test_django_shop.py.",
    "celery -A proj beat": "docs/django.md: a Django project's beat; run against the Django example "
    "in tests/acceptance/test_django_shop.py.",
    "python -m pip install": "installs the package from the clone's root into the reader's "
    "environment (here it would replace the suite's own editable install). Checked instead: "
    "tests/unit/test_packaging.py (the declared requirements cover a Redis broker; the "
    "documented lines install from source, every extra explained); the fresh-virtualenv run "
    "(worker and beat on Redis after only this line) is done by hand, see CHANGELOG.md.",
    "cd examples/django_shop": "only sets the directory of the next command (the screenshot script).",
    "python -m benchmarks.console": "loads 2 million rows and times every console page for a minute or "
    "two on a shared machine; figures belong in benchmarks/ (docs/console.md quotes its output).",
    "python -m examples.console_screenshot": "drives headless Chromium against the console to make "
    "docs/images/console-*.png by hand; tests/acceptance/test_web_browser.py drives the same pages.",
    "python screenshot.py": "drives headless Chromium against the Django example running with a "
    "superuser, to make docs/images/*.png by hand; the example's README itself is run by "
    "tests/acceptance/test_django_shop.py.",
}


@dataclass(frozen=True)
class Command:
    """One documented command and where it is written."""

    document: str
    line: int
    text: str
    listed: bool = False  # from a plain listing, not a ``$`` line or a shell block

    @property
    def synopsis(self) -> bool:
        return self.listed and ("..." in self.text or " [" in self.text)

    @property
    def where(self) -> str:
        return f"{self.document}:{self.line}"


def documented_commands(path: Path) -> list[Command]:
    """The console commands of one Markdown document, in order."""
    commands: list[Command] = []
    info: str | None = None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("```"):
            info = None if info is not None else stripped[3:].strip().lower()
            continue
        if info is None:
            continue
        listed = False
        if stripped.startswith("$ "):
            text = stripped[2:]
        elif info in SHELL_BLOCKS and stripped and not stripped.startswith("#"):
            text = stripped
        elif info in LISTING_BLOCKS and (
            stripped.split(" ")[0] in LISTED or stripped.startswith("python -m ")
        ):
            text, listed = stripped, True
        else:
            continue
        commands.append(Command(path.relative_to(ROOT).as_posix(), number, text, listed))
    return commands


def _words(text: str) -> list[str]:
    return shlex.split(text, comments=True)


def _not_run_reason(command: Command) -> str | None:
    words = _words(command.text)
    for prefix, reason in NOT_RUN.items():
        if words[: len(prefix.split())] == prefix.split():
            return reason
    return None


def _readme_project(tmp: Path, dsn: str, broker: str) -> None:
    """Write the README's ``proj/outbox.py`` block, placeholders substituted."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"```python\n(# proj/outbox\.py\n.*?)```", text, re.DOTALL)
    assert match is not None, "README.md no longer has its `# proj/outbox.py` block"
    source = match.group(1).replace(DOC_DSN, dsn).replace(DOC_BROKER, broker)
    (tmp / "proj").mkdir()
    (tmp / "proj" / "__init__.py").write_text("")
    (tmp / "proj" / "outbox.py").write_text(source)


def _env(dsn: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "CELERY_"))}
    env["OUTBOX_DSN"] = dsn
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _refused(code: int | None, output: str) -> bool:
    """The CLI's documented refusal: exit 1 and one ``Error:`` line (no usage error, no traceback)."""
    lines = [line for line in output.splitlines() if line.strip()]
    return code == 1 and len(lines) == 1 and lines[0].startswith("Error: ")


def _run_server(
    command: str, kind: str, cwd: Path, env: dict[str, str], refusal_ok: bool = False
) -> str | None:
    """Start a worker or beat, wait for its ready line, SIGTERM it; an error text or None."""
    log = cwd / f"{kind}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["bash", "-c", f"exec {command}"],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + TIMEOUT
        while READY[kind] not in log.read_text(errors="replace"):
            if proc.poll() is not None:
                if refusal_ok and _refused(proc.returncode, log.read_text(errors="replace")):
                    return REFUSED + log.read_text(errors="replace").strip()
                return f"exited {proc.returncode} before it was ready:\n{log.read_text()[-3000:]}"
            if time.monotonic() > deadline:
                return f"not ready after {TIMEOUT:.0f} s:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        try:
            code = proc.wait(timeout=STAY_UP)
        except subprocess.TimeoutExpired:
            pass
        else:
            return f"exited {code} after its banner:\n{log.read_text()[-3000:]}"
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=TIMEOUT)
        if code != 0:
            return f"exit {code} after SIGTERM:\n{log.read_text()[-3000:]}"
        return None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# How each program behind a make target parses its arguments (exit 2 on a bad one).
_ARG_PARSERS = {
    "examples.demo": "from examples.demo.engine import _parse; _parse(sys.argv[1:])",
    "benchmarks": "from benchmarks.__main__ import _parser; _parser().parse_args(sys.argv[1:])",
    "chaos": "from chaos.runner import _parse; _parse(sys.argv[1:])",
}


def _check_make(command: Command, env: dict[str, str]) -> str | None:
    """``make -n`` the target; parse the arguments it would pass with the program's parser."""
    words = _words(command.text)
    dry = subprocess.run(
        ["make", "-n", *words[1:]], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )
    if dry.returncode != 0:
        return f"make -n: exit {dry.returncode}\n{dry.stderr}"
    for line in dry.stdout.splitlines():
        parts = shlex.split(line)
        if len(parts) >= 3 and parts[1] == "-m" and parts[2] in _ARG_PARSERS:
            parsed = subprocess.run(
                [sys.executable, "-c", "import sys; " + _ARG_PARSERS[parts[2]], *parts[3:]],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            if parsed.returncode != 0:
                return f"{parts[2]} refuses {parts[3:]}:\n{parsed.stderr[-2000:]}"
    return None


def _run(command: Command, cwd: Path, env: dict[str, str], dsn: str, broker: str) -> str | None:
    text = command.text.replace(DOC_DSN, dsn).replace(DOC_BROKER, broker)
    words = _words(text)
    if words[0] == "make":
        return _check_make(command, env)
    if words[0] == "celery" and ("worker" in words or "beat" in words):
        return _run_server(text, "worker" if "worker" in words else "beat", cwd, env)
    if words[0] == "outbox-celery" and "metrics" in words:
        return _run_server(text, "metrics", cwd, env, refusal_ok=command.listed)
    if words[0] == "outbox-celery" and "web" in words:
        return _run_server(text, "web", cwd, env, refusal_ok=command.listed)
    result = subprocess.run(
        ["bash", "-c", text], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT, check=False
    )
    if command.listed and _refused(result.returncode, result.stderr):
        return REFUSED + result.stderr.strip()
    if result.returncode != 0:
        return f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return None


def _uri(dsn: str) -> str:
    """``dsn`` as a ``postgresql://`` URI, the form the documents show (one shell word)."""
    params = {k: str(v) for k, v in conninfo_to_dict(dsn).items()}
    assert set(params) <= {"user", "password", "host", "port", "dbname"}, sorted(params)
    user = quote(params.get("user", ""), safe="")
    password = ":" + quote(params["password"], safe="") if "password" in params else ""
    host = quote(params.get("host", ""), safe="")
    port = f":{params['port']}" if "port" in params else ""
    return f"postgresql://{user}{password}@{host}{port}/{quote(params.get('dbname', ''), safe='')}"


@pytest.fixture
def fresh_dsn(server_dsn: str) -> Iterator[str]:
    """A fresh database holding the business table the README's example writes to."""
    with temporary_database(server_dsn) as db:
        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute("CREATE TABLE orders (id bigserial PRIMARY KEY, total integer NOT NULL)")
        yield _uri(db)


def test_the_extraction_finds_the_documented_commands() -> None:
    """Guards the test below against finding nothing (a renamed block kind, a moved file)."""
    found = {c.text for path in DOCUMENTS for c in documented_commands(path)}
    assert "outbox-celery migrate --dsn postgresql://app@localhost/app     # idempotent, versioned" in found
    assert "outbox-celery migrate --check; echo $?" in found
    assert any(t.startswith("celery -A proj.outbox beat") for t in found)
    for prefix in NOT_RUN:  # a stale allowlist entry is an error too
        assert any(_words(t)[: len(prefix.split())] == prefix.split() for t in found), prefix


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_documented_command_works(
    document: Path, fresh_dsn: str, redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    commands = documented_commands(document)
    if not commands:
        pytest.skip(f"{document.name} shows no console command")
    _readme_project(tmp_path, fresh_dsn, redis_url)
    env = _env(fresh_dsn)
    failures: list[str] = []
    report: list[str] = [f"substituted: {DOC_DSN} -> a fresh database; {DOC_BROKER} -> the test broker"]
    for text in PREREQUISITES.get(commands[0].document, []):
        error = _run(Command(commands[0].document, 0, text), tmp_path, env, fresh_dsn, redis_url)
        assert error is None, f"prerequisite {text!r} of {document.name} failed: {error}"
        report.append(f"prerequisite from the prose: {text}")
    for command in commands:
        if command.synopsis:
            report.append(f"{command.where}: {command.text}\n    synopsis, not a command")
            continue
        reason = _not_run_reason(command)
        if reason is not None and _words(command.text)[0] != "make":
            # make targets are still checked (make -n, their arguments parsed); others not run.
            report.append(f"{command.where}: {command.text}\n    not run: {reason}")
            continue
        error = _run(command, tmp_path, env, fresh_dsn, redis_url)
        if error is not None and error.startswith(REFUSED):
            report.append(f"{command.where}: {command.text}\n    ran, {error}")
            continue
        verdict = "FAILED" if error else ("checked, not run: " + reason if reason else "ran")
        report.append(f"{command.where}: {command.text}\n    {verdict}")
        if error:
            failures.append(f"{command.where}: {command.text}\n{error}")
    with capsys.disabled():
        print("\n" + "\n".join(report))
    assert not failures, "\n\n".join(failures)
