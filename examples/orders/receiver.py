"""The webhook receiver: another team's service, de-duplicating with a transactional inbox.

``python -m examples.orders.receiver [--port 8080] [--max-rate N] [--drop-every N]``

``POST /webhooks`` with an ``Idempotency-Key`` header. In one transaction it records the key
in its inbox (:mod:`outbox_celery.inbox`, table ``receiver.webhook_inbox``) and, only when the
key is new, applies the effect (updates its view of the order in ``receiver.orders``). A
redelivered event finds its key and changes nothing: at-least-once delivery, exactly-once effect.

Fault injection, to show what the outbox does about a misbehaving downstream (off by default):

``--max-rate N``
    At most ``N`` requests a second (a window per wall-clock second, across every event type):
    the requests beyond are answered ``429`` with ``Retry-After: 1``, as a rate-limited API
    would. The outbox's handlers answer that with ``RateLimited``, which holds their event type
    back on every worker, so the 429s stay few.
``--drop-every N``
    For one key in ``N``, the first request is applied and committed, then the connection is
    closed without an answer: the handler sees an error and retries, and the redelivery must
    have no second effect.

Every request and its outcome goes to ``receiver.requests``.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
import zlib
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from outbox_celery import inbox

from . import settings
from ._http import JsonHandler, serve
from .schema import INBOX_TABLE, ensure_receiver_schema

__all__ = ["Receiver", "main"]

logger = logging.getLogger("examples.orders.receiver")

RETRY_AFTER = 1


def _picked(key: str, salt: str, every: int) -> bool:
    return every > 0 and zlib.crc32(f"{salt}:{key}".encode()) % every == 0


class Receiver:
    """The receiver's logic, independent of HTTP (the handler below only translates).

    :param pool: connections to the receiver's database.
    :param max_rate: answer 429 to the requests beyond this many in a second (0: never).
    :param drop_every: drop the connection after committing the first request of one key in
        this many (0: never).
    """

    def __init__(self, pool: ConnectionPool[Any], *, max_rate: int = 0, drop_every: int = 0) -> None:
        self.pool = pool
        self.max_rate = max_rate
        self.drop_every = drop_every
        self._lock = threading.Lock()
        self._dropped: set[str] = set()
        self._window = 0
        self._in_window = 0

    def _over_rate(self) -> bool:
        if self.max_rate <= 0:
            return False
        with self._lock:
            window = int(time.time())
            if window != self._window:
                self._window, self._in_window = window, 0
            self._in_window += 1
            return self._in_window > self.max_rate

    def _first_time(self, seen: set[str], key: str) -> bool:
        with self._lock:
            if key in seen:
                return False
            seen.add(key)
            return True

    def _log(self, conn: psycopg.Connection[Any], key: str, event: dict[str, Any], outcome: str) -> None:
        conn.execute(
            "INSERT INTO receiver.requests (idempotency_key, event_type, order_id, outcome)"
            " VALUES (%s, %s, %s, %s)",
            [key, event.get("event_type") or "?", event.get("order_id"), outcome],
        )

    def receive(self, key: str, event: dict[str, Any]) -> str:
        """Handle one webhook; return the outcome.

        ``throttled``: answer 429. ``applied``/``duplicate``: answer 200. ``applied_dropped``:
        applied and committed, now drop the connection.
        """
        if self._over_rate():
            with self.pool.connection() as conn:
                self._log(conn, key, event, "throttled")
            return "throttled"
        with self.pool.connection() as conn, conn.transaction():
            if not inbox.first_time(conn, key, event_type=event["event_type"], table=INBOX_TABLE):
                outcome = "duplicate"
            else:
                self._apply(conn, event)
                drop = _picked(key, "drop", self.drop_every) and self._first_time(self._dropped, key)
                outcome = "applied_dropped" if drop else "applied"
            self._log(conn, key, event, outcome)
        return outcome

    def _apply(self, conn: psycopg.Connection[Any], event: dict[str, Any]) -> None:
        event_type = event["event_type"]
        order_id = event["order_id"]
        conn.execute(
            "INSERT INTO receiver.orders AS r (order_id, events, paid, shipped) VALUES (%s, 1, %s, %s)"
            " ON CONFLICT (order_id) DO UPDATE SET events = r.events + 1,"
            " paid = r.paid OR excluded.paid, shipped = r.shipped OR excluded.shipped,"
            " updated_at = now()",
            [order_id, event_type == "order.paid", event_type == "order.shipped"],
        )
        if event_type == "order.status_changed":
            data = event.get("data") or {}
            # SET expressions read the old row: a change is in sequence when it is the next seq.
            conn.execute(
                "UPDATE receiver.orders SET"
                " out_of_order = out_of_order + CASE WHEN %(seq)s = status_seq + 1 THEN 0 ELSE 1 END,"
                " status = CASE WHEN %(seq)s > status_seq THEN %(status)s ELSE status END,"
                " status_seq = greatest(status_seq, %(seq)s)"
                " WHERE order_id = %(order_id)s",
                {"seq": int(data.get("seq", 0)), "status": str(data.get("status")), "order_id": order_id},
            )


def _handler(receiver: Receiver) -> type[JsonHandler]:
    class Handler(JsonHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server API
            if self.path != "/health":
                self.reply(404, {"error": "not found"})
                return
            with receiver.pool.connection() as conn:
                conn.execute("SELECT 1")
            self.reply(200, {"status": "ok"})

        def do_POST(self) -> None:  # noqa: N802 - http.server API
            if self.path != "/webhooks":
                self.reply(404, {"error": "not found"})
                return
            key = (self.headers.get("Idempotency-Key") or "").strip()
            try:
                event = self.read_json()
                if not isinstance(event, dict) or not isinstance(event.get("event_type"), str):
                    raise ValueError("expected an object with event_type")
                event["order_id"] = int(event["order_id"])
            except (ValueError, KeyError, TypeError) as exc:
                self.reply(400, {"error": f"bad request: {exc}"})
                return
            if not key:
                self.reply(400, {"error": "missing Idempotency-Key header"})
                return
            outcome = receiver.receive(key, event)
            if outcome == "throttled":
                self.reply(429, {"error": "slow down"}, {"Retry-After": str(RETRY_AFTER)})
            elif outcome == "applied_dropped":
                # Committed, but the sender never hears about it: it must retry, and the retry
                # must find the key in the inbox.
                logger.info("dropped the connection after applying %s", key)
                self.close_connection = True
            else:
                self.reply(200, {"result": outcome})

    return Handler


def main(argv: list[str] | None = None) -> int:
    """Run the receiver until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(prog="python -m examples.orders.receiver", description=__doc__)
    parser.add_argument("--host", default=os.environ.get("RECEIVER_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=settings.RECEIVER_PORT)
    env = os.environ.get
    parser.add_argument("--max-rate", type=int, default=int(env("RECEIVER_MAX_RATE") or 0))
    parser.add_argument("--drop-every", type=int, default=int(env("RECEIVER_DROP_EVERY") or 0))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    dsn = settings.receiver_dsn()
    with psycopg.connect(dsn, autocommit=True) as conn:
        ensure_receiver_schema(conn)
    pool: ConnectionPool[Any] = ConnectionPool(
        dsn, min_size=1, max_size=8, kwargs={"autocommit": True}, name="receiver", open=True
    )
    receiver = Receiver(pool, max_rate=args.max_rate, drop_every=args.drop_every)
    serve(_handler(receiver), host=args.host, port=args.port, name="receiver", on_stop=pool.close)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
