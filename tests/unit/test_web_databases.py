"""``outbox-celery web --dsn [NAME=]DSN``: how the console names its databases, and what it
refuses, without quoting a DSN."""

from __future__ import annotations

import pytest

from outbox_celery.cli.web import databases_from
from outbox_celery.web import Database


def test_names_come_from_the_option_or_the_database() -> None:
    dbs = databases_from(
        [
            "shop=postgresql://app:pw@db1/shop",
            "postgresql://app@db2/billing",
            "host=db3 dbname=stock user=app",
            "postgresql://app@db4/billing",
        ],
        table="outbox",
    )
    assert [d.name for d in dbs] == ["shop", "billing", "stock", "billing-4"]
    assert dbs[0].dsn == "postgresql://app:pw@db1/shop"
    assert all(d.table == "outbox" for d in dbs)


def test_a_malformed_dsn_is_refused_without_quoting_it() -> None:
    with pytest.raises(ValueError) as caught:
        databases_from(["host=db1 password=hunter2 dbname"], table="outbox")
    assert "hunter2" not in str(caught.value)


def test_a_database_never_shows_its_dsn() -> None:
    db = Database("shop", "postgresql://app:hunter2@db1/shop")
    assert "hunter2" not in repr(db) and "db1" not in repr(db)
    with pytest.raises(ValueError, match="invalid console database name"):
        Database("a b", "postgresql://x")


def test_with_the_app_each_database_knows_its_handlers_and_claim_interval() -> None:
    class App:
        handlers = {"order.paid@receipt": object(), "mail.sent": object()}

        class config:  # noqa: N801 - the Outbox's attribute
            claim_interval = 2.5

    [db] = databases_from(["postgresql://app@db1/shop"], table="outbox", outbox=App())
    assert db.handlers == frozenset({"order.paid@receipt", "mail.sent"}) and db.claim_interval == 2.5
    [bare] = databases_from(["postgresql://app@db1/shop"], table="outbox")
    assert bare.handlers is None and bare.claim_interval is None
