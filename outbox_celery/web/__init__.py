"""The operator console: an ASGI app (Starlette, server-rendered Jinja2 templates) over one or
several outbox tables (docs/console.md).

``outbox-celery web --dsn ...`` serves it; :func:`create_app` mounts it into a FastAPI or
Starlette service::

    from outbox_celery.web import Database, create_app
    app.mount("/outbox", create_app([Database("orders", dsn)], actions=True, authorize=is_staff))

Needs the ``web`` extra (``pip install 'outbox-celery[web]'``).
"""

from __future__ import annotations

from .app import Database, create_app

__all__ = ["Database", "create_app"]
