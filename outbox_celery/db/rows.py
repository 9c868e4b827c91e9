"""Rows read by column name: one typed row per statement's result.

Every statement the library runs reads its result into a small row type (a ``NamedTuple`` or a
dataclass) whose fields are named after the query's columns. The names are checked once per
result, never per row: a column renamed, moved or added in a query either still lands in its
field or fails loudly, never in the wrong field. When the columns are the fields in order (the
statements are written so), each row is made from the driver's values by position after that
check, the driver's fast path; otherwise by name.

:func:`read` runs a statement and returns its typed rows; :func:`factory` is the row factory of
a psycopg cursor; :func:`maker` serves results whose column names come from elsewhere (the
producer's, read through any driver).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import psycopg
from psycopg.abc import Params, QueryNoTemplate
from psycopg.rows import RowFactory, RowMaker

__all__ = ["factory", "fields", "maker", "read"]

R = TypeVar("R")


def fields(cls: type[Any]) -> tuple[str, ...]:
    """The field names of a row type (a ``NamedTuple`` or a dataclass), in order."""
    named: tuple[str, ...] | None = getattr(cls, "_fields", None)
    if named is not None:
        return named
    return tuple(f.name for f in dataclasses.fields(cls))


# Makers by (row type, columns): each result's columns are checked once per process.
_MAKERS: dict[tuple[type[Any], tuple[Any, ...]], Callable[[Sequence[Any]], Any]] = {}


def _maker(cls: type[Any], columns: tuple[str, ...]) -> Callable[[Sequence[Any]], Any]:
    made = _MAKERS.get((cls, columns))
    if made is None:
        made = _MAKERS[(cls, columns)] = _checked(cls, columns)
    return made


def _checked(cls: type[Any], columns: tuple[str, ...]) -> Callable[[Sequence[Any]], Any]:
    names = fields(cls)
    unknown = [c for c in columns if c not in names]
    missing = [f for f in _required(cls) if f not in columns]
    if unknown or missing or len(set(columns)) < len(columns):
        raise TypeError(f"the query's columns {columns} do not match {cls.__name__}{names}")
    if columns == names and hasattr(cls, "_make"):
        return cast(Callable[[Sequence[Any]], Any], cls._make)
    if columns == names[: len(columns)]:
        # The fields after the columns keep their defaults.
        return lambda values: cls(*values)
    return lambda values: cls(**dict(zip(columns, values, strict=True)))


def _required(cls: type[Any]) -> tuple[str, ...]:
    """The fields of a row type that have no default."""
    defaults: dict[str, Any] | None = getattr(cls, "_field_defaults", None)
    if defaults is not None:
        return tuple(f for f in fields(cls) if f not in defaults)
    return tuple(
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )


def maker(cls: type[R], columns: Sequence[str]) -> Callable[[Sequence[Any]], R]:
    """What makes a ``cls`` of each row of a result whose columns are ``columns``.

    Every column must name a field of ``cls``, and every field without a default must have its
    column; the other fields keep their defaults.

    :raises TypeError: a column names no field (or names one twice), or a field lacks its column.
    """
    return cast(Callable[[Sequence[Any]], R], _maker(cls, tuple(columns)))


def read(
    conn: psycopg.Connection[Any], cls: type[R], query: QueryNoTemplate, params: Params | None = None
) -> list[R]:
    """Run ``query`` on ``conn`` (on a cursor of its own); its rows as ``cls``, by column name."""
    with conn.cursor(row_factory=factory(cls)) as cur:
        return cur.execute(query, params).fetchall()


def factory(cls: type[R]) -> RowFactory[R]:
    """A psycopg row factory making a ``cls`` of each row, by column name (:func:`maker`).

    The cursor's own: the rows come out typed whatever row factory the connection has (a
    caller's connection may return dicts). One per row type, made once.
    """
    made = _FACTORIES.get(cls)
    if made is None:
        made = _FACTORIES[cls] = _factory(cls)
    return cast(RowFactory[R], made)


_FACTORIES: dict[type[Any], RowFactory[Any]] = {}


def _factory(cls: type[R]) -> RowFactory[R]:
    def make(cursor: Any) -> RowMaker[R]:
        res = cursor.pgresult  # its column names, without building the description
        if res is None:
            return cast(RowMaker[R], _no_result)
        return cast(RowMaker[R], _of_result(cls, tuple(res.fname(i) for i in range(res.nfields))))

    return make


def _of_result(cls: type[Any], raw: tuple[bytes | None, ...]) -> Callable[[Sequence[Any]], Any]:
    """:func:`_maker` of a result's raw column names (libpq's bytes), cached as they come.

    A result whose columns do not match gets a maker that raises: a cursor runs statements whose
    results nobody reads (the completer's key locks), and only a row made of it is wrong.
    """
    made = _MAKERS.get((cls, raw))
    if made is None:
        try:
            made = _maker(cls, tuple((name or b"").decode() for name in raw))
        except TypeError as exc:
            made = functools.partial(_refuse, exc)
        _MAKERS[(cls, raw)] = made
    return made


def _refuse(exc: TypeError, values: Sequence[Any]) -> Any:
    raise TypeError(*exc.args)


def _no_result(values: Sequence[Any]) -> Any:
    raise TypeError("the statement has no result yet")
