"""``POST /orders/`` with ``customer`` and ``total``: places an order, returns it as JSON."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from .services import place_order


@csrf_exempt  # an API endpoint of the example, called with curl
@require_POST
def place_order_view(request: HttpRequest) -> HttpResponse:
    """Place an order from form fields ``customer`` and ``total``."""
    try:
        customer, total = request.POST["customer"], int(request.POST["total"])
    except (KeyError, ValueError):
        return JsonResponse({"error": "customer and an integer total are required"}, status=400)
    order = place_order(customer, total)
    return JsonResponse({"order_id": order.pk, "customer": order.customer, "total": order.total}, status=201)
