"""``python manage.py place_order --customer ada --total 42``."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from orders.services import place_order


class Command(BaseCommand):
    help = "Place an order (its order.placed event is written in the same transaction)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--customer", required=True)
        parser.add_argument("--total", type=int, required=True)

    def handle(self, *args: Any, **options: Any) -> None:
        order = place_order(options["customer"], options["total"])
        self.stdout.write(f"placed order {order.pk} for {order.customer}")
