"""A project module for ``celery -A support.report_app report``: the DSN given one documented way.

``OUTBOX_REPORT_WAY`` picks the way (see docs/celery.md, "Keeping the DSN secret"):

* ``keyword``: ``Outbox(app, dsn=...)``;
* ``env``: the ``OUTBOX_DSN`` environment variable, nothing in the code;
* ``pgpassword``: ``outbox_dsn`` without a password, the password in ``PGPASSWORD``;
* ``passfile``: ``outbox_dsn`` naming a libpq ``passfile``.

``OUTBOX_REPORT_DSN`` is the DSN the test expects the outbox to end up with; importing this
module fails if it does not, so a way that silently loses the DSN cannot pass.
"""

from __future__ import annotations

import os

from celery import Celery

from outbox_celery import Outbox

way = os.environ["OUTBOX_REPORT_WAY"]
expected = os.environ["OUTBOX_REPORT_DSN"]

app = Celery("report_app", broker="redis://127.0.0.1:1/0", set_as_current=False)
if way == "keyword":
    outbox = Outbox(app, dsn=expected)
elif way == "env":
    outbox = Outbox(app)
elif way in ("pgpassword", "passfile", "celery_setting"):
    app.conf.outbox_dsn = expected
    outbox = Outbox(app)
else:  # pragma: no cover - a test typo
    raise RuntimeError(f"unknown OUTBOX_REPORT_WAY {way!r}")

if outbox.config.dsn != expected:
    raise RuntimeError(f"the outbox did not get its DSN the {way} way")
