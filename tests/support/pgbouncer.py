"""A real ``pgbouncer`` in transaction pooling mode in front of the test PostgreSQL server.

:func:`pgbouncer` starts the Debian binary on a free port with a private configuration
(``pool_mode = transaction``, trust authentication towards the test server) and yields a function
that rewrites a test DSN to go through it. Tests skip with the reason when the binary is missing.
PgBouncer refuses to run as root; as root it is started with ``-u`` (``nobody``, or the owner of
the server's Unix socket directory).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from outbox_celery.testing import free_port


def binary() -> str | None:
    """The ``pgbouncer`` executable, or ``None``."""
    return shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.path.exists(p)), None
    )


@contextlib.contextmanager
def pgbouncer(server_dsn: str, *, pool_size: int = 20) -> Iterator[Callable[[str], str]]:
    """Run PgBouncer (transaction mode) in front of ``server_dsn``'s server.

    Yields ``through(dsn) -> dsn``: the same database and user, reached through PgBouncer.
    """
    exe = binary()
    if exe is None:
        pytest.skip("pgbouncer not installed (Debian: apt-get install pgbouncer)")
    server = conninfo_to_dict(server_dsn)
    host = str(server.get("host") or "127.0.0.1")
    port = int(server.get("port") or 5432)
    user = str(server.get("user") or "postgres")
    listen = free_port()
    with tempfile.TemporaryDirectory(prefix="outbox-pgbouncer-") as tmp:
        d = Path(tmp)
        d.chmod(0o777)  # run as nobody when we are root: it writes its pid and socket here
        (d / "userlist.txt").write_text(f'"{user}" ""\n')
        ini = d / "pgbouncer.ini"
        ini.write_text(
            "\n".join(
                [
                    "[databases]",
                    f"* = host={host} port={port}",
                    "[pgbouncer]",
                    "listen_addr = 127.0.0.1",
                    f"listen_port = {listen}",
                    f"unix_socket_dir = {d}",
                    "auth_type = trust",
                    f"auth_file = {d / 'userlist.txt'}",
                    "pool_mode = transaction",
                    f"default_pool_size = {pool_size}",
                    "max_client_conn = 500",
                    # libpq and psycopg send these at startup; PgBouncer must not refuse them.
                    "ignore_startup_parameters = extra_float_digits,options",
                    "server_reset_query =",
                    # Rotate server connections between transactions, as many clients would.
                    "server_round_robin = 1",
                    f"pidfile = {d / 'pgbouncer.pid'}",
                    "",
                ]
            )
        )
        for f in d.iterdir():
            f.chmod(0o644)
        cmd = [exe, str(ini)]
        if os.geteuid() == 0:
            # PgBouncer refuses root. A server on a Unix socket (the embedded PostgreSQL) is
            # reachable by the socket directory's owner, a TCP one by anybody.
            owner = "nobody"
            if host.startswith("/"):
                import pwd

                owner = pwd.getpwuid(os.stat(host).st_uid).pw_name
            cmd[1:1] = ["-u", owner]
        log = open(d / "stdout.log", "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 15
            while True:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", listen), 0.5):
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        "pgbouncer did not start:\n" + (d / "stdout.log").read_text(errors="replace")
                    )
                time.sleep(0.05)

            def through(dsn: str) -> str:
                parts = conninfo_to_dict(dsn)
                parts.update(host="127.0.0.1", port=str(listen))
                return make_conninfo("", **parts)

            try:
                yield through
            except BaseException:
                # Shown with the failure: PgBouncer says why it refused or dropped a connection.
                print("pgbouncer log:\n" + (d / "stdout.log").read_text(errors="replace")[-6000:])
                raise
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            log.close()
