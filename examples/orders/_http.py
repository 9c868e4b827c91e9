"""What the API and the receiver share: a threaded stdlib HTTP server that stops cleanly."""

from __future__ import annotations

import json
import logging
import signal
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["JsonHandler", "serve"]

logger = logging.getLogger(__name__)

MAX_BODY = 1024 * 1024


class JsonHandler(BaseHTTPRequestHandler):
    """Request helpers: read a JSON body, answer JSON, log through :mod:`logging`."""

    protocol_version = "HTTP/1.1"
    server_version = "outbox-orders-example"

    def read_json(self) -> Any:
        """The request body decoded as JSON; raise ``ValueError`` when it is not."""
        length = int(self.headers.get("Content-Length") or 0)
        if length < 0 or length > MAX_BODY:
            raise ValueError("body too large")
        raw = self.rfile.read(length) if length else b""
        return json.loads(raw or b"null")

    def reply(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        """Answer ``status`` with ``body`` as JSON."""
        data = json.dumps(body, default=str).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)


def serve(
    handler: type[BaseHTTPRequestHandler],
    *,
    host: str,
    port: int,
    name: str,
    on_stop: Callable[[], None] | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT, then stop accepting, finish, and call ``on_stop``."""
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    stop = threading.Event()

    def _stop(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    thread = threading.Thread(target=server.serve_forever, name=f"{name}-http", kwargs={"poll_interval": 0.2})
    thread.start()
    logger.info("%s listening on http://%s:%s", name, host, server.server_address[1])
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.shutdown()
        thread.join()
        server.server_close()
        if on_stop is not None:
            on_stop()
        logger.info("%s stopped", name)
