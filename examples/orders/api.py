"""A tiny HTTP API over :mod:`.producer`: the orders service's front door.

``python -m examples.orders.api [--port 8000]``

=============================  =====================================================
``POST /orders``               ``{"customer": "ada", "total_cents": 4200}`` -> 201 ``{"id": 1}``
``POST /orders/<id>/pay``      record the payment -> 200 ``{"id": 1, "status": "paid"}``
``POST /orders/<id>/ship``     record the shipment -> 200 ``{"id": 1, "status": ...}``
``GET /orders/<id>``           the order and the delivery state of each of its events
``GET /health``                200 when the database answers
=============================  =====================================================

Each write is one transaction holding the order change and its outbox events.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from typing import Any

from psycopg_pool import ConnectionPool

from . import settings
from ._http import JsonHandler, serve
from .producer import OrderError, create_order, get_order, pay_order, ship_order

__all__ = ["main"]

logger = logging.getLogger("examples.orders.api")

_ACTION = re.compile(r"^/orders/(\d+)/(pay|ship)$")
_ORDER = re.compile(r"^/orders/(\d+)$")


def _handler(pool: ConnectionPool[Any]) -> type[JsonHandler]:
    class Handler(JsonHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server API
            try:
                if self.path == "/health":
                    with pool.connection() as conn:
                        conn.execute("SELECT 1")
                    self.reply(200, {"status": "ok"})
                    return
                match = _ORDER.match(self.path)
                if match is None:
                    self.reply(404, {"error": "not found"})
                    return
                with pool.connection() as conn:
                    self.reply(200, get_order(conn, int(match.group(1))))
            except OrderError as exc:
                self.reply(exc.status, {"error": str(exc)})

        def do_POST(self) -> None:  # noqa: N802 - http.server API
            try:
                body = self.read_json()
            except ValueError as exc:
                self.reply(400, {"error": f"bad JSON: {exc}"})
                return
            try:
                if self.path == "/orders":
                    if not isinstance(body, dict):
                        raise OrderError("expected a JSON object", 400)
                    with pool.connection() as conn:
                        order_id = create_order(
                            conn,
                            customer=body.get("customer", ""),  # validated by create_order
                            total_cents=body.get("total_cents", -1),
                            currency=str(body.get("currency") or "EUR"),
                            source=str(body.get("source") or "api"),
                        )
                    self.reply(201, {"id": order_id, "status": "created"})
                    return
                match = _ACTION.match(self.path)
                if match is None:
                    self.reply(404, {"error": "not found"})
                    return
                order_id, action = int(match.group(1)), match.group(2)
                with pool.connection() as conn:
                    status = pay_order(conn, order_id) if action == "pay" else ship_order(conn, order_id)
                self.reply(200, {"id": order_id, "status": status})
            except OrderError as exc:
                self.reply(exc.status, {"error": str(exc)})

    return Handler


def main(argv: list[str] | None = None) -> int:
    """Run the API until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(prog="python -m examples.orders.api", description=__doc__)
    parser.add_argument("--host", default=os.environ.get("API_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=settings.API_PORT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    dsn = settings.outbox_dsn()
    assert dsn is not None
    pool: ConnectionPool[Any] = ConnectionPool(
        dsn, min_size=1, max_size=8, kwargs={"autocommit": True}, name="orders-api", open=True
    )
    serve(_handler(pool), host=args.host, port=args.port, name="orders api", on_stop=pool.close)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
