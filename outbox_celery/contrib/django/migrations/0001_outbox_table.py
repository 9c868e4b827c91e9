"""Create (or upgrade) the outbox table with the library's own SQL migrations.

The schema lives in ``outbox_celery/sql``; this migration only calls
:func:`outbox_celery.migrate` for ``CELERY_OUTBOX_TABLE`` on ``OUTBOX_DATABASE``, so the table
is the same one ``outbox-celery migrate`` builds. Reversing it is a no-op: the events stay.
Later library versions are applied by the app's ``post_migrate`` hook on every ``migrate``.
"""

from __future__ import annotations

from django.db import migrations, models

from outbox_celery.contrib.django.migration import backwards, forwards


class Migration(migrations.Migration):
    initial = True
    dependencies = []

    operations = [
        migrations.RunPython(forwards, backwards, elidable=False),
        # The model is unmanaged (the table above is the library's): Django records its state
        # but never creates, alters or drops it.
        migrations.CreateModel(
            name="OutboxMessage",
            fields=[("id", models.BigAutoField(primary_key=True, serialize=False))],
            options={"managed": False},
        ),
    ]
