"""``outbox-celery groups`` as operators run it (DESIGN invariant 29): a real subprocess."""

from __future__ import annotations

import json
from typing import Any

import psycopg

from acceptance.test_cli import ok, run
from outbox_celery import Event, group


def test_groups_list_show_finish_cancel(conn: psycopg.Connection[Any], migrated_dsn: str, table: str) -> None:
    ids = []
    for n in range(2):
        with conn.transaction():
            parts = [Event("part", {"i": i}, "p", i) for i in range(3)]
            ids.append(group(conn, parts, then=Event("done", {"n": n}, "p", n), table=table).id)
    listed = ok(run("--table", table, "groups", "list", dsn=migrated_dsn))
    assert "0 of 3" in listed and str(ids[0]) in listed
    shown = json.loads(ok(run("--table", table, "groups", "show", str(ids[0]), "--json", dsn=migrated_dsn)))
    assert (shown["state"], shown["total"], shown["dead_members"]) == ("open", 3, [])
    out = ok(run("--table", table, "groups", "finish", str(ids[0]), "--reason", "enough", dsn=migrated_dsn))
    assert f"group {ids[0]} finished by hand" in out
    ok(run("--table", table, "groups", "cancel", str(ids[1]), "--reason", "nope", dsn=migrated_dsn))
    assert "no open group" in ok(run("--table", table, "groups", "list", dsn=migrated_dsn))
    states = json.loads(
        ok(run("--table", table, "groups", "list", "--state", "any", "--json", dsn=migrated_dsn))
    )
    assert sorted(g["state"] for g in states) == ["cancelled", "finished"]
    again = run("--table", table, "groups", "cancel", str(ids[1]), "--reason", "x", dsn=migrated_dsn)
    assert again.returncode == 1 and "is not open" in again.stderr
    assert "open groups (oldest)" in ok(run("--table", table, "stats", dsn=migrated_dsn))
