"""Producer input validation, before any SQL: bad input raises ProducerError."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import pytest

from outbox_celery import Event, ProducerError, enqueue, enqueue_many
from outbox_celery.produce.enqueue import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    MAX_AGGREGATE_LENGTH,
    MAX_EVENT_TYPE_LENGTH,
    _row,
    check_transaction,
)


def event(**changes: Any) -> Event:
    fields: dict[str, Any] = {
        "event_type": "order.created",
        "payload": {"total": 12.5, "items": [1, 2]},
        "aggregate_type": "order",
        "aggregate_id": "42",
    }
    fields.update(changes)
    return Event(**fields)


def test_valid_event_becomes_a_row() -> None:
    row = _row(event(), DEFAULT_MAX_PAYLOAD_BYTES)
    assert row == {
        "event_type": "order.created",
        "aggregate_type": "order",
        "aggregate_id": "42",
        "payload": '{"total":12.5,"items":[1,2]}',
        "ordering_key": None,
        "delay": 0.0,
        "dedup_key": None,
        "trace_context": None,
        "limit_key": None,
    }


def test_integer_aggregate_id_becomes_text() -> None:
    assert _row(event(aggregate_id=7), DEFAULT_MAX_PAYLOAD_BYTES)["aggregate_id"] == "7"


def test_ordered_event_keys_on_its_aggregate() -> None:
    assert _row(event(ordered=True), DEFAULT_MAX_PAYLOAD_BYTES)["ordering_key"] == "order:42"


def test_explicit_ordering_key_wins() -> None:
    row = _row(event(ordered=True, ordering_key="customer:9"), DEFAULT_MAX_PAYLOAD_BYTES)
    assert row["ordering_key"] == "customer:9"
    assert _row(event(ordering_key="customer:9"), DEFAULT_MAX_PAYLOAD_BYTES)["ordering_key"] == "customer:9"


@pytest.mark.parametrize(
    ("delay", "seconds"), [(None, 0.0), (0, 0.0), (5, 5.0), (0.25, 0.25), (timedelta(minutes=1), 60.0)]
)
def test_delay_becomes_seconds(delay: Any, seconds: float) -> None:
    row = _row(event(delay=delay), DEFAULT_MAX_PAYLOAD_BYTES)
    assert row["delay"] == seconds
    assert isinstance(row["delay"], float)


@pytest.mark.parametrize(
    "payload", [None, 0, "text", [], {}, {"nested": {"deep": [1, "ü", None, True]}}, "😀", "a\\u0000b"]
)
def test_any_json_value_is_a_valid_payload(payload: Any) -> None:
    _row(event(payload=payload), DEFAULT_MAX_PAYLOAD_BYTES)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"event_type": ""}, "event_type must not be empty"),
        ({"event_type": "   "}, "event_type must not be empty"),
        ({"event_type": "x" * (MAX_EVENT_TYPE_LENGTH + 1)}, "event_type is 201 characters"),
        ({"event_type": None}, "event_type must be a string"),
        ({"event_type": True}, "event_type must be a string"),
        ({"event_type": "a\x00b"}, "NUL"),
        ({"aggregate_type": ""}, "aggregate_type must not be empty"),
        ({"aggregate_type": "x" * (MAX_AGGREGATE_LENGTH + 1)}, "aggregate_type is 201"),
        ({"aggregate_type": 3.5}, "aggregate_type must be a string"),
        ({"aggregate_id": ""}, "aggregate_id must not be empty"),
        ({"aggregate_id": "9" * (MAX_AGGREGATE_LENGTH + 1)}, "aggregate_id is 201"),
        ({"aggregate_id": False}, "aggregate_id must be a string"),
        ({"aggregate_id": [1]}, "aggregate_id must be a string"),
        ({"aggregate_id": None}, "aggregate_id must be a string"),
        ({"ordering_key": ""}, "ordering_key must not be empty"),
        ({"ordering_key": "k" * 402}, "ordering_key is 402"),
        ({"payload": {1, 2}}, "not JSON-serializable"),
        ({"payload": object()}, "not JSON-serializable"),
        ({"payload": math.nan}, "not JSON-serializable"),
        ({"payload": {"x": [math.inf]}}, "not JSON-serializable"),
        ({"payload": {"x": -math.inf}}, "not JSON-serializable"),
        ({"payload": "a\x00b"}, "NUL"),
        ({"payload": {"k\x00": 1}}, "NUL"),
        ({"payload": "\ud800"}, "payload"),  # a lone surrogate: jsonb refuses it
        ({"delay": -1}, "delay must be a number of seconds between 0"),
        ({"delay": timedelta(seconds=-1)}, "delay must be a number of seconds between 0"),
        ({"delay": math.nan}, "delay must be a number of seconds between 0"),
        ({"delay": math.inf}, "delay must be a number of seconds between 0"),
        ({"delay": "5"}, "delay must be a number of seconds between 0"),
        ({"delay": True}, "delay must be a number of seconds between 0"),
        ({"dedup_key": ""}, "dedup_key must not be empty"),
        ({"dedup_key": "k" * 401}, "dedup_key is 401"),
        ({"dedup_key": 7}, "dedup_key must be a string"),
        ({"dedup_key": "a\x00b"}, "NUL"),
    ],
)
def test_bad_event_raises_producer_error(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ProducerError, match=match):
        _row(event(**changes), DEFAULT_MAX_PAYLOAD_BYTES)


def test_payload_size_limit_is_on_the_encoded_json_bytes() -> None:
    payload = "x" * 8  # encodes as 10 bytes of JSON: the quotes count
    assert _row(event(payload=payload), 10)["payload"] == '"xxxxxxxx"'
    with pytest.raises(ProducerError, match="11 bytes as JSON; the limit is 10"):
        _row(event(payload=payload + "x"), 10)
    with pytest.raises(ProducerError, match="bytes as JSON"):
        _row(event(payload="é" * 5), 10)  # 5 characters, 12 bytes of UTF-8 JSON


def test_check_transaction_refuses_anything_but_a_psycopg_connection() -> None:
    with pytest.raises(ProducerError, match="psycopg 3 Connection"):
        check_transaction(object(), allow_autocommit=False)  # type: ignore[arg-type]


def test_enqueue_validates_before_touching_the_connection() -> None:
    with pytest.raises(ProducerError, match="event_type must not be empty"):
        enqueue(None, event_type="", payload={}, aggregate_type="a", aggregate_id=1)  # type: ignore[arg-type]


def test_enqueue_many_names_the_bad_message() -> None:
    messages: list[Any] = [
        event(),
        {"event_type": "x", "payload": 1, "aggregate_type": "a", "aggregate_id": ""},
    ]
    with pytest.raises(ProducerError, match="message 1: aggregate_id must not be empty"):
        enqueue_many(None, messages)  # type: ignore[arg-type]


def test_enqueue_many_refuses_unknown_mapping_keys_and_other_types() -> None:
    with pytest.raises(ProducerError, match="message 0"):
        enqueue_many(None, [{"event_type": "x", "payload": 1, "aggregate": "a"}])  # type: ignore[arg-type]
    with pytest.raises(ProducerError, match="message 1: expected Event or mapping, got tuple"):
        enqueue_many(None, [event(), ("x", 1, "a", "1")])  # type: ignore[arg-type, list-item]


def test_absurd_delay_is_refused() -> None:
    with pytest.raises(ProducerError, match="100 years"):
        _row(Event("a.b", {}, "order", 1, delay=1e15), DEFAULT_MAX_PAYLOAD_BYTES)


@pytest.mark.parametrize(
    "field", ["event_type", "aggregate_type", "aggregate_id", "ordering_key", "dedup_key", "limit_key"]
)
def test_a_lone_surrogate_in_a_text_field_is_a_producer_error(field: str) -> None:
    with pytest.raises(ProducerError, match=f"{field} is not valid Unicode: a lone surrogate at position 3"):
        _row(event(**{field: "abc\ud800def"}), DEFAULT_MAX_PAYLOAD_BYTES)


def test_a_payload_nested_too_deep_is_a_producer_error() -> None:
    deep: Any = 1
    for _ in range(10_000):
        deep = [deep]
    with pytest.raises(ProducerError, match="nested deeper than"):
        _row(event(payload=deep), DEFAULT_MAX_PAYLOAD_BYTES)
