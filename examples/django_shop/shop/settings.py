"""Settings of the shop example: a Django project whose orders leave through the outbox.

Environment: ``SHOP_DSN`` (PostgreSQL, libpq URI or key=value string) and ``CELERY_BROKER_URL``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from psycopg.conninfo import conninfo_to_dict

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get("SHOP_SECRET_KEY", "example-only-not-secret")
DEBUG = True
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "outbox_celery.contrib.django",
    "orders",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

ROOT_URLCONF = "shop.urls"
TEMPLATES = [
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
]

_db = conninfo_to_dict(os.environ.get("SHOP_DSN", "postgresql://postgres@127.0.0.1:5432/shop"))
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _db.get("dbname", "shop"),
        "USER": _db.get("user", ""),
        "PASSWORD": _db.get("password", ""),
        "HOST": _db.get("host", ""),
        "PORT": _db.get("port", ""),
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "static/"

# -- Celery (app.config_from_object("django.conf:settings", namespace="CELERY")) -------------
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
CELERY_TASK_IGNORE_RESULT = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BEAT_SCHEDULE_FILENAME = os.environ.get(
    "SHOP_BEAT_SCHEDULE", str(Path(tempfile.gettempdir()) / "shop-celerybeat-schedule")
)

# -- the outbox: the workers read CELERY_OUTBOX_*, the Django app CELERY_OUTBOX_TABLE -------
# No CELERY_OUTBOX_DSN: shop/celery.py hands the DSN of OUTBOX_DATABASE to the Outbox, so no
# setting holds the password (celery report and the debug page print settings).
CELERY_OUTBOX_TABLE = "outbox"
CELERY_OUTBOX_LEASE = 30
# No CLAIM_INTERVAL: the worker claims at each commit (push); beat's claim every 5 s (the
# default) is the safety net.
CELERY_OUTBOX_MAX_ATTEMPTS = 5
CELERY_OUTBOX_BACKOFF_BASE = 0.5
CELERY_OUTBOX_BACKOFF_CAP = 5
OUTBOX_DATABASE = "default"  # the alias holding the outbox table
