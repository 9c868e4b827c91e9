"""The outbox table's ``errors`` column (migration 0013 of the library, DESIGN invariant 32): one
entry per failed attempt, which the unmanaged model reads as ``OutboxMessage.errors``. The
column comes with the library's migrations, applied here so that an app's migration depending on
this one finds it; the app's ``post_migrate`` hook applies them too.
"""

from __future__ import annotations

from django.db import migrations

from outbox_celery.contrib.django.migration import backwards, forwards


class Migration(migrations.Migration):
    dependencies = [("outbox_celery", "0002_outbox_group")]

    operations = [migrations.RunPython(forwards, backwards, elidable=False)]
