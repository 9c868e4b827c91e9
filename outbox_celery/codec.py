"""The payload codec: kombu's JSON, the serializer of Celery's task arguments (DESIGN invariant 27).

A payload is written with :func:`encode` and handed to the handler through :func:`decode`,
which together are ``kombu.utils.json.dumps`` and ``kombu.utils.json.loads``: the types kombu
carries in Celery's arguments (``Decimal``, ``datetime``, ``date``, ``time``, ``UUID``,
``bytes``, and any added with :func:`register_type`) come back as themselves, wrapped on the
way as ``{"__type__": marker, "__value__": ...}``. The column is ``json`` (migration 0010), which
keeps the text as written: key order and number spelling (``1e+20`` stays a float).

A payload that would not come back as itself is refused by :func:`encode` with a
:class:`PayloadError`, except for the conversions Celery's JSON makes to task arguments too,
which are documented (docs/celery.md, "What a payload may hold"):

* a ``tuple`` comes back as a ``list``;
* a key that is not a string (``int``, ``float``, ``bool``, ``None``) comes back as JSON spells
  it (``1`` as ``"1"``, ``True`` as ``"true"``); two keys that would collide are refused;
* a subclass of ``str``, ``int``, ``float``, ``dict`` or ``list`` (a ``StrEnum``, an
  ``IntEnum``, an ``OrderedDict``) comes back as that base type, with an equal value;
* an aware ``datetime`` or ``time`` comes back with its UTC offset as a fixed
  ``datetime.timezone`` (a ``ZoneInfo`` is not kept), equal to the original.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import date, datetime, time
from typing import Any, TypeVar

import kombu.utils.json

from .errors import PayloadError as PayloadError

__all__ = ["MAX_DEPTH", "PayloadError", "decode", "encode", "register_type"]

#: The deepest nesting of lists and objects a payload may have. The handler receives the payload
#: through a decode that takes two Python frames per level, inside a worker's own stack: a
#: payload deeper than this would fail before its handler on every attempt, so it is refused
#: at enqueue. A registered type's value counts its own levels, its envelope one more.
MAX_DEPTH = 200

T = TypeVar("T")

# The containers and scalars JSON itself carries; their subclasses come back as these.
_PLAIN = (str, bool, int, float, type(None))
_KEYS = (str, int, float, bool, type(None))


def register_type(t: type[T], marker: str, encoder: Callable[[T], Any], decoder: Callable[[Any], T]) -> None:
    """Teach the payload codec (and Celery's JSON, which is the same) one more type.

    ``encoder`` turns a value into JSON (any value :func:`encode` accepts), ``decoder`` turns
    that back; the value travels as ``{"__type__": marker, "__value__": encoder(value)}``. This
    is ``kombu.utils.json.register_type``: call it at import time in every process that writes
    or handles such payloads (producers and workers), as for a Celery task argument. A type
    registered in the producer only makes the worker fail before the handler (``last_error``
    names the marker; the row is retried), never hand over the envelope.
    """
    if not isinstance(marker, str) or not marker:
        raise PayloadError("a payload type needs a marker: without one it would not come back as itself")
    kombu.utils.json.register_type(t, marker, encoder, decoder)


def encode(value: Any) -> str:
    """``value`` as kombu's JSON text, refused with :class:`PayloadError` if it would not come
    back as itself through :func:`decode` (beyond the documented conversions above).

    NaN and infinities are refused (PostgreSQL's ``json`` rejects them), as are texts holding
    NUL (``\\u0000``, which PostgreSQL cannot turn into text when the payload is searched) and
    nesting deeper than :data:`MAX_DEPTH`.
    """
    try:
        return _encode(value)
    except RecursionError:
        raise PayloadError(f"nested deeper than {MAX_DEPTH} levels of lists and objects") from None


def _encode(value: Any) -> str:
    try:
        text: str = kombu.utils.json.dumps(value, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
        text.encode("utf-8")  # a lone surrogate is refused here, not by PostgreSQL
    except (TypeError, ValueError) as exc:
        raise PayloadError(f"not JSON-serializable by kombu's JSON: {exc}") from exc
    try:
        back = kombu.utils.json.loads(text)
    except Exception as exc:  # an envelope of an unknown marker, a decoder that raises
        raise PayloadError(f"would not come back as itself: decoding it fails ({exc})") from exc
    _same(value, back, "payload", 0)
    return text


def decode(value: Any) -> Any:
    """A payload as the handler receives it, from the ``json`` column as psycopg loads it
    (``json.loads``): kombu's object hook applied to every object, innermost first, which is
    exactly ``kombu.utils.json.loads`` of the stored text.

    :raises PayloadError: an envelope whose marker no :func:`register_type` of this process
        knows.
    """
    if isinstance(value, list):
        return [decode(item) for item in value]
    if isinstance(value, dict):
        inner = {key: decode(item) for key, item in value.items()}
        try:
            return kombu.utils.json.object_hook(inner)
        except ValueError as exc:
            raise PayloadError(
                f"the payload holds a value of type {inner.get('__type__')!r} that this process "
                "cannot decode: register it (outbox_celery.codec.register_type) in the worker too"
            ) from exc
    return value


def _key(key: Any) -> str:
    """The key JSON writes for a dict key (``json.dumps``' rule)."""
    if isinstance(key, str):
        return key
    if isinstance(key, bool) or key is None:
        return {True: "true", False: "false", None: "null"}[key]
    if isinstance(key, float):
        return float.__repr__(key)
    return int.__repr__(key)


def _same(sent: Any, back: Any, where: str, depth: int) -> None:
    """Refuse (:class:`PayloadError`) when ``back`` is not ``sent`` up to the documented
    conversions, or nests deeper than :data:`MAX_DEPTH` (``depth``: the levels above it)."""
    if isinstance(back, dict | list) and depth >= MAX_DEPTH:
        raise PayloadError(f"nested deeper than {MAX_DEPTH} levels of lists and objects (at {where[:80]})")
    if isinstance(sent, dict):
        if not isinstance(back, dict):
            _refuse(
                where, sent, back, "an object of exactly the keys __type__ and __value__ is a typed value"
            )
        if len(back) != len(sent):
            _refuse(where, sent, back, "two keys become one (keys are written as JSON strings)")
        for (key, item), (key_back, item_back) in zip(sent.items(), back.items(), strict=True):
            if not isinstance(key, _KEYS) or _key(key) != key_back:
                _refuse(where, key, key_back, "a key that is not a string, number, bool or None")
            _same(item, item_back, f"{where}[{key!r}]", depth + 1)
        return
    if isinstance(sent, list | tuple):
        if not isinstance(back, list) or len(back) != len(sent):
            _refuse(where, sent, back)
        for i, (item, item_back) in enumerate(zip(sent, back, strict=True)):
            _same(item, item_back, f"{where}[{i}]", depth + 1)
        return
    expected = _base(sent)
    if type(back) is not expected or not _equal(sent, back):
        _refuse(where, sent, back)


def _base(value: Any) -> type:
    """The type ``value`` comes back as: JSON's own for its scalars' subclasses, else its own."""
    for plain in _PLAIN:
        if isinstance(value, plain) and (plain is not int or not isinstance(value, bool)):
            return plain
    return type(value)


def _equal(sent: Any, back: Any) -> bool:
    if isinstance(sent, float) and math.isnan(sent):
        return False
    if isinstance(sent, datetime | time) and sent.tzinfo is not None:
        # The offset is kept, the zone object is not (documented).
        return bool(back == sent and back.utcoffset() == sent.utcoffset())
    if isinstance(sent, datetime | time):
        return bool(back == sent and back.tzinfo is None)
    if isinstance(sent, date):
        return bool(back == sent)
    try:
        return bool(back == sent)
    except Exception:
        return False


def _refuse(where: str, sent: Any, back: Any, why: str = "") -> None:
    detail = f": {why}" if why else ""
    raise PayloadError(
        f"{where} would not come back as itself{detail}: {_show(sent)} would arrive as {_show(back)}"
        " (pass a JSON value, or register the type with outbox_celery.codec.register_type)"
    )


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"
