"""An order, and whether its confirmation went out (written by the outbox handler)."""

from __future__ import annotations

from django.db import models


class Order(models.Model):
    """One order of one customer."""

    customer = models.CharField(max_length=100)
    total = models.IntegerField()
    created_at = models.DateTimeField(auto_now_add=True)
    confirmation_sent_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"order {self.pk} of {self.customer}"
