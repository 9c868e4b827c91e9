"""The DSN's password stays out of ``celery report`` / ``celery inspect conf``.

Celery masks settings whose names it knows (``*PASS*``, ``*SECRET*``, ``broker_url``...), not
``outbox_dsn``. Every way docs/celery.md documents as safe runs the real ``celery report`` and
the password must not appear; the configuration table ``celery inspect conf`` returns is checked
too. Giving the password inside ``outbox_dsn`` is the documented unsafe way: the worker warns.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from celery import Celery
from support.processes import REPO_ROOT, TESTS_DIR

from outbox_celery import Outbox

PASSWORD = "s3cret-report-pw"
WITH_PASSWORD = f"postgresql://app:{PASSWORD}@db.example:5432/app"
WITHOUT_PASSWORD = "postgresql://app@db.example:5432/app"


def _report(way: str, expected_dsn: str, extra_env: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG"))}
    env.update(
        PYTHONPATH=os.pathsep.join([str(TESTS_DIR), str(REPO_ROOT)]),
        OUTBOX_REPORT_WAY=way,
        OUTBOX_REPORT_DSN=expected_dsn,
        **extra_env,
    )
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "support.report_app", "report"],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


@pytest.mark.parametrize("way", ["keyword", "env", "pgpassword", "passfile"])
def test_celery_report_shows_no_password_for_every_documented_way(way: str, tmp_path: Path) -> None:
    extra: dict[str, str] = {}
    expected = WITH_PASSWORD
    if way == "env":
        extra["OUTBOX_DSN"] = WITH_PASSWORD
    elif way == "pgpassword":
        expected = WITHOUT_PASSWORD
        extra["PGPASSWORD"] = PASSWORD
    elif way == "passfile":
        passfile = tmp_path / "pgpass"
        passfile.write_text(f"db.example:5432:app:app:{PASSWORD}\n")
        passfile.chmod(0o600)
        expected = f"{WITHOUT_PASSWORD}?passfile={passfile}"
    out = _report(way, expected, extra)
    assert "outbox.claim" in out  # the real report ran on our app (its beat schedule)
    assert PASSWORD not in out


def test_inspect_conf_table_shows_no_password_for_the_env_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """``celery inspect conf`` answers with ``app.conf.table(censored=True)`` from the worker."""
    monkeypatch.setenv("OUTBOX_DSN", WITH_PASSWORD)
    app = Celery("conf_table", broker="redis://127.0.0.1:1/0", set_as_current=False)
    outbox = Outbox(app)
    assert outbox.config.dsn == WITH_PASSWORD
    for with_defaults in (False, True):
        assert PASSWORD not in repr(app.conf.table(with_defaults=with_defaults))
    assert outbox.check_worker_settings(pool="prefork") == []


def test_a_password_in_outbox_dsn_is_printed_by_celery_so_the_worker_warns() -> None:
    out = _report("celery_setting", WITH_PASSWORD, {})
    assert PASSWORD in out  # Celery's own masking does not know outbox_dsn: why it is unsafe
    app = Celery("unsafe", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.outbox_dsn = WITH_PASSWORD
    problems = Outbox(app).check_worker_settings(pool="prefork")
    assert any(
        "outbox_dsn or outbox_listen_dsn in the Celery configuration holds a password" in p for p in problems
    )
    assert not any(PASSWORD in p for p in problems)


def test_invariant_19_a_password_in_outbox_listen_dsn_makes_the_worker_warn_too() -> None:
    # `celery report` printed outbox_listen_dsn with its password, and no warning said so.
    app = Celery("unsafe_listen", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.outbox_listen_dsn = WITH_PASSWORD
    problems = Outbox(app, dsn=WITHOUT_PASSWORD).check_worker_settings(pool="prefork")
    assert any("outbox_listen_dsn" in p and "holds a password" in p for p in problems)
    assert not any(PASSWORD in p for p in problems)


DJANGO_DEBUG_PAGE = """
import django
from django.views.debug import ExceptionReporter

django.setup()
import shop.celery  # the Celery app module, as a worker loads it

try:
    raise ValueError("boom")
except ValueError as exc:
    print(ExceptionReporter(None, type(exc), exc, exc.__traceback__).get_traceback_html())
print(shop.celery.outbox.config.dsn is not None)
"""


def test_invariant_19_the_documented_django_setup_keeps_the_password_out_of_report_and_debug_page() -> None:
    # docs/django.md (and the shop example) put database_dsn(DATABASES[...]) in
    # CELERY_OUTBOX_DSN, which `celery report` and Django's debug page print, password included.
    pytest.importorskip("django")
    shop = REPO_ROOT / "examples" / "django_shop"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG", "CELERY_"))}
    env.update(
        PYTHONPATH=os.pathsep.join([str(shop), str(REPO_ROOT)]),
        DJANGO_SETTINGS_MODULE="shop.settings",
        SHOP_DSN=WITH_PASSWORD,
        CELERY_BROKER_URL="redis://127.0.0.1:1/0",
    )
    report = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "shop", "report"],
        env=env,
        cwd=shop,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert report.returncode == 0, report.stdout + report.stderr
    assert "outbox.claim" in report.stdout  # the real report of the shop's app
    assert PASSWORD not in report.stdout + report.stderr
    page = subprocess.run(
        [sys.executable, "-c", DJANGO_DEBUG_PAGE],
        env=env,
        cwd=shop,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert page.returncode == 0, page.stderr
    assert "DATABASES" in page.stdout and page.stdout.rstrip().endswith("True")
    assert PASSWORD not in page.stdout + page.stderr
