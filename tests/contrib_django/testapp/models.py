"""Business data written in the same transaction as the events."""

from django.db import models


class Order(models.Model):
    """A tiny order."""

    total = models.IntegerField()

    class Meta:
        app_label = "testapp"
