"""The Celery app of the shop and its outbox.

Every ``CELERY_*`` Django setting configures Celery, ``CELERY_OUTBOX_*`` ones the outbox::

    celery -A shop worker -Q outbox.claim,outbox --loglevel=INFO
    celery -A shop beat --loglevel=INFO
"""

from __future__ import annotations

import os

from celery import Celery

from outbox_celery import Outbox
from outbox_celery.contrib.django import outbox_dsn

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")

app = Celery("shop")
app.config_from_object("django.conf:settings", namespace="CELERY")

# The database Django writes to (OUTBOX_DATABASE), given to the Outbox rather than set as
# CELERY_OUTBOX_DSN: no setting holds the password, so celery report and Django's debug page
# cannot print it.
outbox = Outbox(app, dsn=outbox_dsn())

# The handlers register on ``outbox``: every process that loads the app knows them.
from orders import handlers  # noqa: E402, F401
