"""Loads the named SQL files shipped in ``outbox_celery/sql`` (once per process)."""

from __future__ import annotations

import functools
import re
from importlib import resources

from psycopg import sql

from .config import TableName

_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)

INDEX_SUFFIXES = {
    "pending_idx": "_pending_idx",
    "lease_idx": "_lease_idx",
    "ordered_idx": "_ordered_idx",
    "done_idx": "_done_idx",
    "dead_idx": "_dead_idx",
    "heads_idx": "_heads_idx",
    "dedup_idx": "_dedup_idx",
    "keyed_idx": "_keyed_idx",
    "key_lease_idx": "_key_lease_idx",
}


# The table beside each outbox table that holds its identity (the idempotency keys' discriminator).
INSTANCE_SUFFIX = "_instance"
# The table beside each outbox table that holds its flow-control state per event type (#23).
FLOW_SUFFIX = "_flow"
# The table beside each outbox table that holds pauses and holds per limit key (#23).
FLOW_KEY_SUFFIX = "_flow_key"


@functools.cache
def read(name: str) -> str:
    """The text of ``sql/<name>`` inside the package."""
    return resources.files("outbox_celery").joinpath("sql", *name.split("/")).read_text(encoding="utf-8")


@functools.cache
def named(filename: str) -> dict[str, str]:
    """Split a ``-- name: x`` annotated file into ``{x: text}``."""
    text = read(filename)
    parts = _NAME.split(text)
    # parts = [preamble, name1, body1, name2, body2, ...]
    queries: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        queries[name] = body.strip().rstrip(";")
    return queries


def compose(text: str, table: TableName) -> sql.Composed:
    """Bind the table (and its index names) as quoted identifiers into ``text``."""
    idents: dict[str, sql.Composable] = {
        "table": table.identifier(),
        # The table's identity (migration 0006): one row beside it, named after it.
        "instance_table": table.identifier(INSTANCE_SUFFIX),
        # Pause, RateLimited holds and rate buckets per event type (migration 0007, #23).
        "flow_table": table.identifier(FLOW_SUFFIX),
        # Pause and RateLimited holds per limit key (migration 0008, #23).
        "flow_key_table": table.identifier(FLOW_KEY_SUFFIX),
        "flow_key_held_idx": table.index_name(FLOW_KEY_SUFFIX + "_held_idx"),
    }
    idents.update({k: table.index_name(v) for k, v in INDEX_SUFFIXES.items()})
    used = {k: v for k, v in idents.items() if "{" + k + "}" in text}
    # SQL(...) marks the file text as trusted: it ships with the package, never user input.
    return sql.SQL(text).format(**used)
