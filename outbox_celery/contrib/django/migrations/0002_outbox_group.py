"""The model over the groups' table (``<CELERY_OUTBOX_TABLE>_group``, migration 0012 of the
library, DESIGN invariant 29): unmanaged, as the messages' model. The table itself comes with
the library's migrations, which the app's ``post_migrate`` hook applies.
"""

from __future__ import annotations

from django.db import migrations, models

from outbox_celery.contrib.django.conf import model_db_table
from outbox_celery.contrib.django.migration import backwards, forwards


class Migration(migrations.Migration):
    dependencies = [("outbox_celery", "0001_outbox_table")]

    operations = [
        migrations.RunPython(forwards, backwards, elidable=False),
        migrations.CreateModel(
            name="OutboxGroup",
            fields=[("id", models.BigAutoField(primary_key=True, serialize=False))],
            options={
                "managed": False,
                "db_table": model_db_table() + "_group",
                "verbose_name": "outbox group",
                "verbose_name_plural": "outbox groups",
            },
        ),
    ]
