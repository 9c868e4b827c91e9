"""The payload codec is kombu's JSON (DESIGN invariant 27), property-based: any JSON value and
any value of kombu's registered types comes back as itself (type included), as
``kombu.utils.json.loads`` gives it back to a Celery task; what would not is refused, and the
conversions Celery makes too are the documented ones.
"""

from __future__ import annotations

import json
import uuid
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from enum import IntEnum, StrEnum
from typing import Any

import kombu.utils.json
import pytest
from hypothesis import given, settings
from support.payloads import JSON_VALUES, PAYLOADS, same

from outbox_celery import codec


def through_the_column(value: Any) -> Any:
    """What the handler gets: encoded, stored, loaded by psycopg (``json.loads``), decoded."""
    return codec.decode(json.loads(codec.encode(value)))


@settings(max_examples=300)
@given(JSON_VALUES)
def test_invariant_27_every_json_value_comes_back_as_itself(value: Any) -> None:
    assert same(value, through_the_column(value))


@settings(max_examples=300)
@given(PAYLOADS)
def test_invariant_27_kombus_registered_types_come_back_as_themselves(value: Any) -> None:
    text = codec.encode(value)
    assert same(value, through_the_column(value))
    # The same decoder as Celery's arguments: kombu's loads of the stored text.
    assert same(kombu.utils.json.loads(text), through_the_column(value))
    assert same(kombu.utils.json.loads(kombu.utils.json.dumps(value)), through_the_column(value))


def test_invariant_27_the_cases_of_the_report_come_back_as_sent() -> None:
    for value in [{"b": 1, "a": 2}, 1e20, Decimal("1.10"), -0.0, 10**30, "1", "", [], {}]:
        assert same(value, through_the_column(value)), value
    assert list(through_the_column({"b": 1, "a": 2})) == ["b", "a"]
    assert type(through_the_column(1e20)) is float


class Colour(StrEnum):
    RED = "red"


class Size(IntEnum):
    S = 1


@pytest.mark.parametrize(
    ("sent", "arrives"),
    [
        ((1, "a"), [1, "a"]),
        ({1: "a", 2.5: "b", False: "c", None: "d"}, {"1": "a", "2.5": "b", "false": "c", "null": "d"}),
        ({"c": Colour.RED, "s": Size.S}, {"c": "red", "s": 1}),
    ],
)
def test_the_documented_conversions_are_celerys_own(sent: Any, arrives: Any) -> None:
    back = through_the_column(sent)
    assert same(arrives, back)
    assert same(kombu.utils.json.loads(kombu.utils.json.dumps(sent)), back)  # what a task argument gets


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ({1: "a", "1": "b"}, "two keys become one"),
        ({"__type__": "decimal", "__value__": "1.10"}, "typed value"),
        ({"__type__": "nobody", "__value__": 1}, "decoding it fails"),
        ({(1, 2): "x"}, "not JSON-serializable"),
        ({1, 2}, "not JSON-serializable"),
        (float("nan"), "not JSON-serializable"),
        (Decimal("NaN"), "would not come back as itself"),
        (type("Reduced", (), {"__json__": lambda self: {"x": 1}})(), "would not come back as itself"),
    ],
)
def test_invariant_27_what_would_not_come_back_as_itself_is_refused(value: Any, why: str) -> None:
    with pytest.raises(codec.PayloadError, match=why):
        codec.encode(value)


class Money:
    def __init__(self, cents: int) -> None:
        self.cents = cents

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Money) and other.cents == self.cents

    __hash__ = None  # type: ignore[assignment]


def test_a_registered_type_comes_back_and_celery_reads_it_too() -> None:
    with pytest.raises(codec.PayloadError, match="not JSON-serializable"):
        codec.encode({"price": Money(110)})
    codec.register_type(Money, "test_money", lambda m: m.cents, Money)
    try:
        assert same({"price": Money(110)}, through_the_column({"price": Money(110)}))
        text = codec.encode(Money(5))
        assert kombu.utils.json.loads(text) == Money(5)
    finally:
        kombu.utils.json._encoders.pop(Money, None)
        kombu.utils.json._decoders.pop("test_money", None)
    with pytest.raises(codec.PayloadError, match="cannot decode"):
        codec.decode(json.loads(text))
    with pytest.raises(codec.PayloadError, match="needs a marker"):
        codec.register_type(Money, "", lambda m: m.cents, Money)


def test_aware_values_keep_their_offset() -> None:
    paris = datetime(2026, 1, 1, 12, tzinfo=timezone(timedelta(hours=1)))
    assert through_the_column(paris).utcoffset() == timedelta(hours=1)
    assert same(uuid.UUID(int=7), through_the_column(uuid.UUID(int=7)))
    assert same(date(2026, 1, 2), through_the_column(date(2026, 1, 2)))


def _nested(depth: int) -> Any:
    value: Any = 0
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


@pytest.mark.parametrize("depth", [codec.MAX_DEPTH + 1, 550, 900, 10_000])
def test_a_payload_nested_deeper_than_the_worker_decodes_is_refused(depth: int) -> None:
    with pytest.raises(codec.PayloadError, match=f"nested deeper than {codec.MAX_DEPTH} levels"):
        codec.encode(_nested(depth))


def test_the_deepest_accepted_payload_decodes_inside_a_deep_stack() -> None:
    text = codec.encode(_nested(codec.MAX_DEPTH))

    def under(frames: int) -> Any:
        return under(frames - 1) if frames else codec.decode(json.loads(text))

    assert under(300) == _nested(codec.MAX_DEPTH)
