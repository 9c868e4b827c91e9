"""The module ``celery -A support.worker_app worker|beat`` loads in acceptance tests.

It builds the test app from the :class:`~support.apps.AppSpec` in ``OUTBOX_TEST_APP`` and
records Celery's retry and failure signals, so tests can assert that Celery's own retry
machinery never runs for outbox deliveries.
"""

from __future__ import annotations

from typing import Any

from celery import signals

from support.apps import AppSpec, build_app, record_signal

spec = AppSpec.from_env()
if spec.transactional and spec.transactional_kind == "django":
    # Django's connection on the test database, for transactional="django" handlers.
    import django
    from django.conf import settings
    from psycopg.conninfo import conninfo_to_dict

    parts = conninfo_to_dict(spec.dsn)
    settings.configure(
        USE_TZ=True,
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": parts.get("dbname"),
                "USER": parts.get("user", ""),
                "PASSWORD": parts.get("password", ""),
                "HOST": parts.get("host", ""),
                "PORT": str(parts.get("port", "")),
                # Persistent connections, as a worker is usually configured: with the default
                # (0) Django would close its connection before each run anyway.
                "CONN_MAX_AGE": None,
            }
        },
    )
    django.setup()
app, outbox = build_app(spec)


@signals.task_retry.connect(weak=False)
def _on_retried(sender: Any = None, request: Any = None, reason: Any = None, **kwargs: Any) -> None:
    record_signal(
        outbox,
        "task_retry",
        getattr(sender, "name", None),
        getattr(request, "id", None),
        repr(reason),
    )


@signals.task_failure.connect(weak=False)
def _on_failure(
    sender: Any = None, task_id: str | None = None, exception: BaseException | None = None, **kwargs: Any
) -> None:
    record_signal(outbox, "task_failure", getattr(sender, "name", None), task_id, repr(exception))
