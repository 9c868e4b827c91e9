"""Passwords stay out of logs, reprs and the locals of a failed delivery (DESIGN invariant
19).

The DSNs here are real ones given to the real code paths: a listener thread reconnecting, the
Prometheus collector scraping, a delivery whose handler raises; what they log and what their
frames hold is read back.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool
from support import steps

from outbox_celery import OutboxConfig, Store
from outbox_celery.claim.listener import Listener
from outbox_celery.handlers import HandlerSpec
from outbox_celery.testing import InProcess

from .helpers import LONG, add

SECRET = "p%zz-s3cret"
# An unencoded "%" in the password: libpq cannot parse the URI and quotes the token.
UNPARSEABLE = f"postgresql://app:{SECRET}@127.0.0.1:1/app"


def test_invariant_19_the_listener_never_logs_a_password_it_could_not_parse(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Logged on every reconnect, quoted by libpq's parse error.
    listener = Listener(
        dsn=UNPARSEABLE,
        store=Store("outbox"),
        claim=lambda: None,
        event_types=lambda: ["e"],
        max_backoff=0.05,
        name="secret-test",
    )
    with caplog.at_level(logging.WARNING, logger="outbox_celery.claim.listener"):
        listener.start()
        deadline = time.monotonic() + 10
        while listener.get_stats()["errors"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        listener.stop()
    text = caplog.text
    assert "reconnecting" in text and "invalid DSN" in text
    assert "s3cret" not in text


def test_invariant_19_the_metrics_collector_never_logs_a_password(
    caplog: pytest.LogCaptureFixture, migrated_dsn: str
) -> None:
    # Logged on every scrape. Unparseable, and parseable with a wrong password
    # (the server's refusal must not echo it either).
    pytest.importorskip("prometheus_client")
    from outbox_celery.ops.metrics import OutboxCollector

    wrong = make_conninfo(migrated_dsn, password="wrong-s3cret", host="127.0.0.1", port="1")
    with caplog.at_level(logging.WARNING, logger="outbox_celery.ops.metrics"):
        for dsn in (UNPARSEABLE, wrong):
            list(OutboxCollector(dsn, "outbox", connect_timeout=1).collect())
    assert caplog.text.count("stats of outbox failed") == 2
    assert "s3cret" not in caplog.text


def test_invariant_19_repr_of_the_config_and_a_failed_deliverys_locals_hold_no_password(
    migrated_dsn: str, conn: psycopg.Connection[Any], table: str
) -> None:
    # repr(OutboxConfig) showed dsn and listen_dsn, and a failed delivery's frames
    # hold the config in a local: error reporters that record locals (Sentry's default) send
    # repr() of each. The password rides in a DSN the server accepts (trust auth ignores it).
    with_secret = make_conninfo(migrated_dsn, password="s3cret-local")
    config = OutboxConfig(table=table, lease=LONG, dsn=with_secret, listen_dsn=with_secret)
    assert "s3cret" not in repr(config)
    assert "s3cret" not in str(config)
    [i] = add(conn, table=table)

    def handler(message: Any) -> None:
        raise ZeroDivisionError("boom")

    with ConnectionPool(with_secret, min_size=1, max_size=1, kwargs={"autocommit": True}, open=True) as pool:
        dispatcher = InProcess(
            config, pool.connection, {"thing.happened": HandlerSpec("thing.happened", handler, "q")}
        )
        [c] = steps.claim(dispatcher.store, conn, limit=1, lease=LONG, owner="w", max_attempts=5).claimed
        with pytest.raises(ZeroDivisionError) as raised:
            dispatcher.deliver(i, c.lease_version)
    frames = 0
    tb = raised.value.__traceback__.tb_next  # the library's frames, below this test's own
    while tb is not None:
        for name, value in tb.tb_frame.f_locals.items():
            assert "s3cret" not in repr(value), f"{tb.tb_frame.f_code.co_name}: local {name!r}"
        frames += 1
        tb = tb.tb_next
    assert frames >= 2
    assert conninfo_to_dict(config.dsn or "")["password"] == "s3cret-local"


def test_invariant_19_an_unparseable_dsn_is_refused_at_configuration_without_quoting_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # psycopg_pool logged libpq's parse error, quoting the password, on every
    # connection attempt of an Outbox's pool. The configuration now refuses such a DSN before
    # anything connects, and neither the error nor its chain quotes it.
    from celery import Celery

    from outbox_celery import ConfigurationError, Outbox

    for name in ("dsn", "listen_dsn"):
        with pytest.raises(ConfigurationError, match="invalid DSN") as refused:
            OutboxConfig(**{name: UNPARSEABLE})
        assert "s3cret" not in str(refused.value)
        assert refused.value.__cause__ is None and refused.value.__suppress_context__
    app = Celery("unparseable", broker="memory://", set_as_current=False)
    with caplog.at_level(logging.DEBUG), pytest.raises(ConfigurationError):
        Outbox(app, dsn=UNPARSEABLE).pool.check()
    assert "s3cret" not in caplog.text
