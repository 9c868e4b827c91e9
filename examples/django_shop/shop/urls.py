"""URLs: the admin and the orders endpoint."""

from django.contrib import admin
from django.urls import path
from orders.views import place_order_view

urlpatterns = [
    path("admin/", admin.site.urls),
    path("orders/", place_order_view),
]
