"""Placing an order: the order and its event commit together, or not at all."""

from __future__ import annotations

from django.db import transaction

from outbox_celery.contrib.django import enqueue

from .models import Order


def place_order(customer: str, total: int) -> Order:
    """Create the order and enqueue ``order.placed`` in the same transaction.

    Ordered per customer: a customer's confirmations go out in the order they were placed.
    """
    with transaction.atomic():
        order = Order.objects.create(customer=customer, total=total)
        enqueue(
            event_type="order.placed",
            payload={"order_id": order.pk, "customer": customer, "total": total},
            aggregate_type="order",
            aggregate_id=order.pk,
            ordering_key=f"customer:{customer}",
        )
    return order
