"""Words of the CLI that misled a new user, run as ``outbox-celery`` subprocesses.

``stats``' done row read "20 purged" when the 20 rows were still there; an unparseable DSN said
only "it could not be parsed", leaving the user to guess which part was wrong. The DSN (and any
part of it: it may hold a password) must still never be shown.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from acceptance.test_cli import ok, one_line_error, run
from outbox_celery import Event, enqueue_many

pytestmark = pytest.mark.slow

SECRET = "Pw-s3cret-26"


def test_stats_says_done_rows_are_kept_not_purged(conn: psycopg.Connection[Any], migrated_dsn: str) -> None:
    with conn.transaction():
        ids = enqueue_many(conn, [Event("order.created", {"n": n}, "order", n) for n in range(3)])
    ok(run("dead", "skip", *map(str, ids), "--reason", "test", dsn=migrated_dsn))
    [done] = [line for line in ok(run("stats", dsn=migrated_dsn)).splitlines() if line.startswith("done ")]
    assert done.split()[:2] == ["done", "3"]
    assert "purged" not in done, done
    assert "delivered or skipped, kept until retention deletes them" in done


@pytest.mark.parametrize(
    ("dsn", "kind"),
    [
        (f"postgresql://app:{SECRET}%zz@localhost/app", "invalid percent-encoded token"),
        (f"postgresql://app:{SECRET}@local host/app", "unexpected spaces found in"),
        (f"host=localhost password={SECRET} dbname", 'missing "=" after <hidden>'),
        (f"host=localhost password=my {SECRET} dbname=app", 'missing "=" after <hidden>'),
        (f"host=localhost password='{SECRET} dbname=app", "unterminated quoted string"),
        (f"hostt=localhost password={SECRET}", "invalid connection option <hidden>"),
    ],
)
def test_an_unparseable_dsn_says_what_kind_of_mistake_and_never_the_dsn(dsn: str, kind: str) -> None:
    line = one_line_error(run("stats", dsn=dsn))
    assert line.startswith(f"Error: invalid DSN: {kind}"), line
    form = "URI form postgresql://" if dsn.startswith("postgresql://") else "key=value form"
    assert form in line, line
    assert SECRET not in line and "localhost" not in line and "app" not in line.split("(")[0], line
