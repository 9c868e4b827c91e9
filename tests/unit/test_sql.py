"""The query registry (``outbox_celery/_sql.py``): every named statement composes, fragments filled."""

from __future__ import annotations

import re

import pytest

from outbox_celery.config import TableName
from outbox_celery.db import statements as _sql

FILES = ["queries.sql", "admin.sql", "console.sql", "inbox/queries.sql", "subscriptions.sql"]
# What compose binds as identifiers; everything else in braces must be a fragment, filled.
IDENTIFIERS = {
    "table",
    "instance_table",
    "flow_table",
    "flow_key_table",
    "subscription_table",
    "group_table",
    *_sql.INDEX_SUFFIXES,
    *_sql.INBOX_INDEX_SUFFIXES,
}


@pytest.mark.parametrize("filename", FILES)
def test_every_placeholder_is_a_fragment_filled_or_an_identifier(filename: str) -> None:
    for name, text in _sql.named(filename).items():
        left = set(re.findall(r"\{(\w*)\}", text))
        assert left <= IDENTIFIERS, name


@pytest.mark.parametrize("filename", FILES)
@pytest.mark.parametrize("table", ["outbox", "billing.outbox_events"])
def test_every_statement_composes_for_a_schema_qualified_table(filename: str, table: str) -> None:
    t = TableName.parse(table)
    queries = _sql.queries(filename, t)
    assert queries
    for name, query in queries.items():
        text = query.as_string(None)
        assert "{" not in text and "}" not in text, name
        if "{table}" in _sql.named(filename)[name]:
            assert t.identifier().as_string(None) in text, name


def test_the_registry_is_composed_once_per_file_and_table() -> None:
    t = TableName.parse("app.outbox")
    assert _sql.queries("queries.sql", t) is _sql.queries("queries.sql", TableName.parse("app.outbox"))


@pytest.mark.parametrize(
    ("fragment", "users"),
    [
        # The producers' key lock: the producers, the ordered done, the operator's skip.
        ("key_lock", {"queries.sql:lock_keys", "queries.sql:lock_key_of", "admin.sql:lock_keys_of_ids"}),
        ("notify_channel", {"queries.sql:notify_channel", "admin.sql:flow_resume"}),
        ("wake_listeners", {"queries.sql:insert", "queries.sql:insert_many", "queries.sql:finish"}),
        ("commit_mode", {"queries.sql:start", "queries.sql:finish"}),
    ],
)
def test_a_shared_rule_is_written_once_and_filled_where_it_is_used(fragment: str, users: set[str]) -> None:
    # The fragment's SQL, filled (a fragment may use another), appears in each statement named.
    filled = _sql.fill("{" + fragment + "}")
    found = {
        f"{filename}:{name}"
        for filename in FILES
        for name, text in _sql.named(filename).items()
        if filled in text
    }
    assert found >= users
    # ... and is written nowhere else in the files by hand.
    for filename in FILES:
        raw = _sql.read(filename)
        assert filled not in raw, filename


def test_the_lock_and_channel_names_are_in_one_place() -> None:
    for filename in FILES:
        raw = _sql.read(filename)
        assert "'outbox_celery:key:'" not in raw, filename
        assert "'outbox_celery_'" not in raw, filename
        assert "set_config('synchronous_commit'" not in raw, filename


def test_every_claim_statement_ends_with_the_one_claim_tail() -> None:
    statements = _sql.named("queries.sql")
    tail = statements["claim_pending"][statements["claim_pending"].index("\nUPDATE") :]
    for name in (
        "claim_expired",
        "claim_heads",
        *(f"claim_{p}_limited" for p in ("expired", "heads", "pending")),
    ):
        assert statements[name].endswith(tail), name


def test_fill_leaves_identifiers_and_unknown_braces_for_compose() -> None:
    assert _sql.fill("SELECT 1 FROM {table}", {"x": "y"}) == "SELECT 1 FROM {table}"
    assert _sql.fill("{a} {b}", {"a": "[{b}]", "b": "B"}) == "[B] B"


@pytest.mark.parametrize("filename", FILES)
def test_a_statement_is_sent_without_its_comment_lines_and_tagged_with_its_name(filename: str) -> None:
    t = TableName.parse("billing.outbox_events")
    for name, query in _sql.queries(filename, t).items():
        text = query.as_string(None)
        assert text.startswith(f"/* outbox-celery {name} */ "), name
        assert not [line for line in text.splitlines() if line.lstrip().startswith("--")], name
        # What is left is the file's SQL, its identifiers bound once.
        kept = [
            line for line in _sql.named(filename)[name].splitlines() if not line.lstrip().startswith("--")
        ]
        assert text.removeprefix(f"/* outbox-celery {name} */ ") == _sql.compose(
            "\n".join(kept), t
        ).as_string(None), name


def test_the_one_message_path_s_statements_fit_psycopg_s_cache_of_converted_queries() -> None:
    # psycopg parses the placeholders of a text above 4,096 bytes again on every execution; the
    # fenced start and finish of one row, the done batch and a claim's statements stay below.
    from psycopg._queries import MAX_CACHED_STATEMENT_LENGTH

    t = TableName.parse("billing.outbox_events")
    queries = _sql.queries("queries.sql", t)
    one = _sql.one_row_queries("queries.sql", t)
    hot = [one["start"], one["finish"], queries["finish"], queries["start"]]
    hot += [queries[n] for n in ("claim_settings_flow", "in_flight_by_route", "claim_pending", "insert_many")]
    for query in hot:
        assert len(query.as_bytes(None)) <= MAX_CACHED_STATEMENT_LENGTH
