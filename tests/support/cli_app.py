"""A project module for the CLI's ``-A``: an Outbox whose handlers declare subscriptions.

The CLI tests run ``outbox-celery -A support.cli_app:outbox ...`` as a subprocess from the
``tests`` directory. The environment gives what a project's settings would:
``CLI_APP_DSN``, ``CLI_APP_TABLE`` (default ``outbox``) and ``CLI_APP_BROKER`` (default
``memory://``, a broker that is always there).

It declares two subscriptions of ``order.paid`` (``receipt`` and ``search``) and an unnamed
handler of ``order.created``.
"""

from __future__ import annotations

import os

from celery import Celery

from outbox_celery import Message
from outbox_celery.app.outbox import Outbox

app = Celery("cli_app", broker=os.environ.get("CLI_APP_BROKER", "memory://"), set_as_current=False)
outbox = Outbox(app, dsn=os.environ["CLI_APP_DSN"], table=os.environ.get("CLI_APP_TABLE", "outbox"))


@outbox.handler("order.paid", name="receipt")
def send_receipt(message: Message) -> None:
    """A subscription of order.paid."""


@outbox.handler("order.paid", name="search")
def index(message: Message) -> None:
    """Another subscription of order.paid."""


@outbox.handler("order.created")
def order_created(message: Message) -> None:
    """The one handler of order.created (no subscription)."""
