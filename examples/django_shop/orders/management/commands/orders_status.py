"""``python manage.py orders_status``: each order and whether its confirmation went out."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from orders.models import Order
from outbox_celery.contrib.django.models import OutboxMessage


class Command(BaseCommand):
    help = "List the orders with their confirmation and the status of their outbox event."

    def handle(self, *args: Any, **options: Any) -> None:
        events = {
            m.payload["order_id"]: m.status for m in OutboxMessage.objects.filter(event_type="order.placed")
        }
        for order in Order.objects.order_by("id"):
            sent = "confirmation sent" if order.confirmation_sent_at else "no confirmation"
            self.stdout.write(f"order {order.pk} {order.customer}: {sent}, event {events.get(order.pk, '-')}")
