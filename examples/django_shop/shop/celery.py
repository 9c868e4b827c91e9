"""The Celery app of the shop and its outbox.

Every ``CELERY_*`` Django setting configures Celery, ``CELERY_OUTBOX_*`` ones the outbox::

    celery -A shop worker -Q outbox.claim,outbox --loglevel=INFO
    celery -A shop beat --loglevel=INFO
"""

from __future__ import annotations

import os

from celery import Celery

from outbox_celery import Outbox

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")

app = Celery("shop")
app.config_from_object("django.conf:settings", namespace="CELERY")

outbox = Outbox(app)

# The handlers register on ``outbox``: every process that loads the app knows them.
from orders import handlers  # noqa: E402, F401
