"""Hypothesis strategies of payloads (DESIGN invariant 27): JSON values, and values of kombu's
registered types, nested; and the comparison a handler would make (types and key order too).
"""

from __future__ import annotations

from datetime import datetime, time, timedelta, timezone
from typing import Any

from hypothesis import strategies as st

# NUL is refused by the producer (PostgreSQL cannot turn \u0000 into text); so are bytes holding
# a zero byte that are valid UTF-8, which kombu writes as text (docs/celery.md).
TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"))
BINARY = st.binary().filter(lambda b: b"\x00" not in b)
OFFSETS = st.builds(lambda m: timezone(timedelta(minutes=m)), st.integers(-23 * 60, 23 * 60))

SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | TEXT
# kombu's registered types (kombu.utils.json._register_default_types, bytes and base64).
TYPED = (
    st.decimals(allow_nan=False, allow_infinity=False)
    | st.datetimes()
    | st.datetimes(timezones=OFFSETS)
    | st.dates()
    | st.times()
    | st.times(timezones=OFFSETS)
    | st.uuids()
    | BINARY
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(TEXT, inner, max_size=5),
    max_leaves=20,
)
PAYLOADS = st.recursive(
    SCALARS | TYPED,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(TEXT, inner, max_size=5),
    max_leaves=20,
)


def same(sent: Any, back: Any) -> bool:
    """Equal, with the same types all the way down, and dict keys in the same order."""
    if type(sent) is not type(back):
        return False
    if isinstance(sent, dict):
        return list(sent) == list(back) and all(same(sent[k], back[k]) for k in sent)
    if isinstance(sent, list):
        return len(sent) == len(back) and all(same(a, b) for a, b in zip(sent, back, strict=True))
    if isinstance(sent, datetime | time) and sent.tzinfo is not None:
        return bool(back == sent and back.utcoffset() == sent.utcoffset())
    return bool(sent == back)
