"""A tiny TCP proxy that a test can freeze: a half-open network path, made to happen.

``FreezableProxy(("127.0.0.1", 6379))`` listens on a free local port and forwards every
connection to the target. :meth:`~FreezableProxy.freeze` stops forwarding in both directions
without closing anything: the client's requests are accepted by the kernel and never answered,
exactly what a client sees when the network drops packets silently (a half-open TCP connection).
New connections made while frozen are accepted and never answered either.
:meth:`~FreezableProxy.thaw` resumes forwarding; :meth:`~FreezableProxy.close` ends it all.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from collections.abc import Callable
from types import TracebackType


class FreezableProxy:
    """Forward ``listen port -> target`` until frozen; one thread per connection."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        # Set here, not in the accept thread: a proxy closed before that thread first ran
        # would have it set a timeout on a closed socket.
        self._listener.settimeout(0.2)
        self.port: int = self._listener.getsockname()[1]
        self._forwarding = threading.Event()
        self._forwarding.set()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._spawn(self._accept_loop)

    def url(self, scheme: str = "redis", path: str = "/0") -> str:
        """A URL that reaches the target through the proxy."""
        return f"{scheme}://127.0.0.1:{self.port}{path}"

    def freeze(self) -> None:
        """Stop forwarding, keep every connection open."""
        self._forwarding.clear()

    def thaw(self) -> None:
        """Forward again (what was sent meanwhile is delivered now)."""
        self._forwarding.set()

    def close(self) -> None:
        """Close the listener and every connection; stop the threads."""
        self._closed.set()
        self._forwarding.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            for s in self._sockets:
                with contextlib.suppress(OSError):
                    s.close()
        for t in self._threads:
            t.join(timeout=5)

    def __enter__(self) -> FreezableProxy:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------

    def _spawn(self, target: object, *args: object) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        self._threads.append(t)
        t.start()

    def _connect_upstream(self) -> socket.socket:
        host, port = self.target
        if host.startswith("/"):
            # A PostgreSQL listening on a Unix socket only (the embedded server): its socket file.
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            upstream.settimeout(5)
            try:
                upstream.connect(f"{host}/.s.PGSQL.{port}")
            except OSError:
                upstream.close()
                raise
            return upstream
        return socket.create_connection(self.target, timeout=5)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = self._connect_upstream()
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, upstream]
            self._spawn(self._pump, client, upstream)

    def _relay(self) -> Callable[[bytes, bool], bytes]:
        """A new connection's hook: what to forward of ``data`` read from the client (``True``)
        or the server; ``b""`` closes the connection both ways. Here: everything, unchanged."""
        return lambda data, from_client: data

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        peer = {client: server, server: client}
        relay = self._relay()
        with selectors.DefaultSelector() as sel:
            for s in (client, server):
                s.setblocking(False)
                sel.register(s, selectors.EVENT_READ)
            while not self._closed.is_set():
                if not self._forwarding.is_set():
                    # Frozen: read nothing, so nothing is forwarded or answered.
                    self._forwarding.wait(0.1)
                    continue
                for key, _ in sel.select(timeout=0.1):
                    src: socket.socket = key.fileobj  # type: ignore[assignment]
                    try:
                        data = src.recv(65536)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if data:
                        data = relay(data, src is client)
                    if not data:
                        for s in (client, server):
                            with contextlib.suppress(OSError):
                                s.close()
                        return
                    with contextlib.suppress(OSError):
                        peer[src].setblocking(True)
                        peer[src].sendall(data)
                        peer[src].setblocking(False)


class ReplyCuttingProxy(FreezableProxy):
    """A proxy that, once armed, lets one request through and loses its reply.

    :meth:`cut_after` arms it: the next client write that contains ``marker`` is forwarded to the
    server, and as soon as the server answers, that connection is closed in both directions
    without the answer reaching the client. The server has run (and, in autocommit, committed)
    the statement; the client sees a connection broken before the reply: "committed, reply
    lost", made to happen on a real socket.
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self._marker: bytes | None = None
        self.cuts = 0
        super().__init__(target)

    def cut_after(self, marker: bytes) -> None:
        """Lose the reply to the next request that contains ``marker`` (once)."""
        self._marker = marker

    def _relay(self) -> Callable[[bytes, bool], bytes]:
        doomed = False

        def cut(data: bytes, from_client: bool) -> bytes:
            nonlocal doomed
            if doomed and not from_client:
                # The server answered the marked request: lose the answer and the link.
                self.cuts += 1
                return b""
            if from_client and self._marker is not None and self._marker in data:
                self._marker = None
                doomed = True
            return data

        return cut
