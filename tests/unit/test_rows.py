"""Rows read by column name (``outbox_celery/db/rows.py``), without a database."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from outbox_celery.claim.executor import ClaimedRow, SettingsRow
from outbox_celery.claim.plan import Seen
from outbox_celery.db import rows

NOW = datetime(2026, 1, 1, tzinfo=UTC)
COLUMNS = ("id", "lease_version", "event_type", "lease_until", "available_at", "attempts")


def _made(cls: type[Any], names: tuple[str, ...], *values: tuple[Any, ...]) -> list[Any]:
    """What :func:`rows.factory` makes of a result with columns ``names`` and rows ``values``."""
    fnames = [n.encode() for n in names]
    cursor = SimpleNamespace(pgresult=SimpleNamespace(nfields=len(names), fname=fnames.__getitem__))
    make = rows.factory(cls)(cursor)
    return [make(v) for v in values]


@dataclass(frozen=True, slots=True)
class _Pair:
    id: int
    note: str = ""


def test_a_row_is_made_of_its_columns_in_order() -> None:
    [row] = _made(ClaimedRow, COLUMNS, (1, 2, "t", NOW, NOW, 0))
    assert row.claimed().lease_version == 2 and row.available_at == NOW
    assert _made(_Pair, ("id", "note"), (3, "x")) == [_Pair(3, "x")]


def test_columns_in_another_order_are_read_by_name() -> None:
    swapped = ("id", "event_type", "lease_version", "lease_until", "available_at", "attempts")
    [row] = _made(ClaimedRow, swapped, (1, "t", 2, NOW, NOW, 0))
    assert (row.lease_version, row.event_type) == (2, "t")
    assert rows.maker(_Pair, ("note", "id"))(("x", 3)) == _Pair(3, "x")


def test_fields_without_a_column_keep_their_defaults() -> None:
    [settings] = _made(SettingsRow, ("jit", "now"), (None, NOW))
    assert settings.seen() == Seen(now=NOW)
    assert rows.maker(_Pair, ("id",))((4,)) == _Pair(4)


@pytest.mark.parametrize(
    "columns",
    [
        ("id", "lease_version", "event_type", "lease_until", "available_at", "attempts", "extra"),
        ("id", "lease_version", "event_type", "lease_until", "available_at"),  # attempts: no default
        ("id", "id", "event_type", "lease_until", "available_at", "attempts"),
    ],
    ids=["a column of no field", "a field without its column", "a column twice"],
)
def test_a_query_whose_columns_do_not_match_its_row_type_fails_loudly(columns: tuple[str, ...]) -> None:
    with pytest.raises(TypeError, match="do not match ClaimedRow"):
        rows.maker(ClaimedRow, columns)
    # A cursor's result fails at its first row: one nobody reads (a lock statement) is fine.
    with pytest.raises(TypeError, match="do not match ClaimedRow"):
        _made(ClaimedRow, columns, (0,) * len(columns))


ROOMS = ("db", "produce", "claim", "worker")
# What a database row is called in these rooms, when it is one.
ROW_NAMES = {"row", "r", "found", "got", "head", "locked", "o", "record", "res"}


def test_the_rooms_read_rows_by_column_name_only() -> None:
    """No positional read of a row in the rooms that run statements: a row is read into its row
    type (db/rows.py) and its columns by name (``rows[0].id`` picks a row, then reads by name)."""
    package = Path(rows.__file__).parent.parent
    found = []
    for room in ROOMS:
        for path in sorted((package / room).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            named = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr == "fetchone":
                    found.append(f"{path.name}:{node.lineno} fetchone")
                if not isinstance(node, ast.Subscript) or id(node) in named:
                    continue
                index = node.slice
                if (
                    not isinstance(index, ast.Slice | ast.Constant)
                    or type(getattr(index, "value", 0)) is not int
                ):
                    continue
                target = node.value
                if isinstance(target, ast.Name) and target.id in ROW_NAMES:
                    found.append(f"{path.name}:{node.lineno} {target.id}[...]")
                call = target.func if isinstance(target, ast.Call) else None
                if isinstance(call, ast.Attribute) and call.attr.startswith("fetch"):
                    found.append(f"{path.name}:{node.lineno} {call.attr}()[...]")
    assert found == []
