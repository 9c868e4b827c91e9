"""Orders in the admin, next to the outbox messages."""

from django.contrib import admin

from .models import Order


@admin.register(Order)
class OrderAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ("id", "customer", "total", "created_at", "confirmation_sent_at")
