"""The app config: keeps the outbox table up to date after every ``manage.py migrate``."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.db.models.signals import post_migrate


class OutboxAppConfig(AppConfig):
    """``outbox_celery.contrib.django``, label ``outbox_celery``."""

    name = "outbox_celery.contrib.django"
    label = "outbox_celery"
    verbose_name = "Outbox"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        post_migrate.connect(_upgrade, sender=self, dispatch_uid="outbox_celery.upgrade")


def _upgrade(sender: AppConfig, using: str, **kwargs: Any) -> None:
    """Apply the library's SQL migrations shipped after this app's Django migration ran.

    A Django migration runs once, but a new release of the library may bring new SQL files:
    ``migrate()`` is idempotent (a no-op when up to date), so every ``manage.py migrate`` on the
    outbox's database brings the table to the installed version.
    """
    from .migration import migrate_outbox

    # Creating the table is the Django migration's job (so `migrate <other app>` creates
    # nothing); upgrading a table it created is this hook's.
    migrate_outbox(using, create=False)
