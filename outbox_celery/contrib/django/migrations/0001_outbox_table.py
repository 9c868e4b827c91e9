"""Create (or upgrade) the outbox table with the library's own SQL migrations.

The schema lives in ``outbox_celery/sql``; this migration only calls
:func:`outbox_celery.migrate` for ``CELERY_OUTBOX_TABLE`` on ``OUTBOX_DATABASE``, so the table
is the same one ``outbox-celery migrate`` builds. Reversing it is a no-op: the events stay.
Later library versions are applied by the app's ``post_migrate`` hook on every ``migrate``.
"""

from __future__ import annotations

from django.db import migrations, models

from outbox_celery.contrib.django.conf import model_db_table
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
            options={
                "managed": False,
                # The configured name, read when migrations load: the state always matches
                # the model, whatever CELERY_OUTBOX_TABLE says (an unmanaged rename is a no-op).
                "db_table": model_db_table(),
                "verbose_name": "outbox message",
                "verbose_name_plural": "outbox messages",
            },
        ),
    ]
