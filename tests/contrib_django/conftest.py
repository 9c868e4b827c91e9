"""A real Django project around the Django app, on a fresh PostgreSQL database per test.

Django is configured once per test process (``settings.configure``) with a placeholder
database; the ``django_db`` fixture points the ``default`` alias at the test's fresh database
(``dsn`` fixture of tests/conftest.py) and runs ``manage.py migrate`` there. The rest of the
suite does not touch Django, so it runs unaffected in the same pytest invocation.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

django = pytest.importorskip("django")

from django.conf import settings  # noqa: E402

if not settings.configured:
    settings.configure(
        DEBUG=False,
        SECRET_KEY="tests-only",
        ALLOWED_HOSTS=["testserver", "127.0.0.1", "localhost"],
        USE_TZ=True,
        INSTALLED_APPS=[
            "django.contrib.admin",
            "django.contrib.auth",
            "django.contrib.contenttypes",
            "django.contrib.sessions",
            "django.contrib.messages",
            "outbox_celery.contrib.django",
            "contrib_django.testapp",
        ],
        MIDDLEWARE=[
            "django.contrib.sessions.middleware.SessionMiddleware",
            "django.middleware.common.CommonMiddleware",
            "django.middleware.csrf.CsrfViewMiddleware",
            "django.contrib.auth.middleware.AuthenticationMiddleware",
            "django.contrib.messages.middleware.MessageMiddleware",
        ],
        ROOT_URLCONF="contrib_django.urls",
        TEMPLATES=[
            {
                "BACKEND": "django.template.backends.django.DjangoTemplates",
                "APP_DIRS": True,
                "OPTIONS": {
                    "context_processors": [
                        "django.template.context_processors.request",
                        "django.contrib.auth.context_processors.auth",
                        "django.contrib.messages.context_processors.messages",
                    ]
                },
            }
        ],
        DATABASES={
            "default": {"ENGINE": "django.db.backends.postgresql", "NAME": "unset"},
            # A second alias on the same database, for using=.
            "other": {"ENGINE": "django.db.backends.postgresql", "NAME": "unset"},
        },
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        PASSWORD_HASHERS=["django.contrib.auth.hashers.MD5PasswordHasher"],
    )
    django.setup()

import uuid  # noqa: E402

import psycopg  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connections  # noqa: E402
from psycopg import sql  # noqa: E402
from psycopg.conninfo import conninfo_to_dict  # noqa: E402

from outbox_celery.testing import temporary_database, with_dbname  # noqa: E402


def point_default_at(dsn: str) -> None:
    """Make Django's ``default`` and ``other`` aliases connect to ``dsn`` (closing its current connection)."""
    parts = conninfo_to_dict(dsn)
    for alias in ("default", "other"):
        wrapper = connections[alias]
        wrapper.close()
        wrapper.settings_dict.update(
            NAME=parts.get("dbname", ""),
            USER=parts.get("user", ""),
            PASSWORD=parts.get("password", ""),
            HOST=parts.get("host", ""),
            PORT=str(parts.get("port", "")),
        )


@pytest.fixture
def django_dsn(dsn: str) -> Iterator[str]:
    """A fresh database that Django's ``default`` alias points at (nothing migrated yet)."""
    point_default_at(dsn)
    try:
        yield dsn
    finally:
        connections.close_all()


@pytest.fixture(scope="session")
def django_template(server_dsn: str) -> Iterator[str]:
    """A database after ``manage.py migrate``, migrated once per session and copied per test."""
    with temporary_database(server_dsn, prefix="outbox_django_template") as template:
        point_default_at(template)
        call_command("migrate", run_syncdb=True, verbosity=0)
        connections.close_all()  # CREATE DATABASE ... TEMPLATE needs it unused
        yield str(conninfo_to_dict(template)["dbname"])


@pytest.fixture
def django_db(server_dsn: str, django_template: str) -> Iterator[str]:
    """A fresh database after ``manage.py migrate`` (Django's tables and the outbox table)."""
    name = f"outbox_test_{uuid.uuid4().hex[:12]}"
    create = sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
        sql.Identifier(name), sql.Identifier(django_template)
    )
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(create)
    dsn = with_dbname(server_dsn, name)
    point_default_at(dsn)
    try:
        yield dsn
    finally:
        connections.close_all()
        with psycopg.connect(server_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
