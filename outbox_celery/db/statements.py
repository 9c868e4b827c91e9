"""The named SQL files shipped in ``outbox_celery/sql``: read, filled and bound once per process.

One registry (:func:`queries`) serves the store, the operator's commands and the inbox. A file
names its statements (``-- name: x``); a rule that several statements must share is written
once, as a fragment, and put where ``{x}`` stands:

* :data:`FRAGMENTS`, in Python, for rules shared across files (lock and channel names) and for
  the lists of steps, generated from :data:`outcomes.STEPS <outbox_celery.outcomes.STEPS>`;
* ``-- fragment: x`` in a file, for a piece only that file's statements share.

Fragments are filled in as text, before the table and its index names are bound as quoted
identifiers (psycopg.sql), so a fragment may use ``{table}`` and bound parameters itself.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from importlib import resources
from types import MappingProxyType

from psycopg import sql

from ..outcomes import NOT_FINAL, STEPS
from ..table import TableName

# "-- name: x" starts a named statement, "-- fragment: x" a piece of the file's statements.
_ENTRY = re.compile(r"^--\s*(name|fragment):\s*(\w+)\s*$", re.MULTILINE)
_PLACEHOLDER = re.compile(r"\{(\w+)\}")

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
    "payload_of_idx": "_payload_of_idx",
    "group_member_idx": "_group_member_idx",
}
# The inbox table's own index (inbox/schema.sql); an outbox table has none of that name.
INBOX_INDEX_SUFFIXES = {"processed_idx": "_processed_idx"}


# The table beside each outbox table that holds its identity (the idempotency keys' discriminator).
INSTANCE_SUFFIX = "_instance"
# The table beside each outbox table that holds its flow-control state per event type.
FLOW_SUFFIX = "_flow"
# The table beside each outbox table that holds pauses and holds per limit key.
FLOW_KEY_SUFFIX = "_flow_key"
# The table beside each outbox table that lists its subscriptions (DESIGN invariant 28).
SUBSCRIPTION_SUFFIX = "_subscription"
# The table beside each outbox table that holds its groups and their callbacks (invariant 29).
GROUP_SUFFIX = "_group"


def literals(values: Iterable[str]) -> str:
    """``'a', 'b'``: the library's own constants as a list of SQL literals, quoted by psycopg."""
    return sql.SQL(", ").join(sql.Literal(str(v)) for v in values).as_string(None)


#: Rules written once for every file. Names are after the table's oid, never after user text:
#: distinct per table, and the same for "outbox" and "public.outbox".
FRAGMENTS: Mapping[str, str] = MappingProxyType(
    {
        # The producers' lock of the ordering key in column "k" (the statement names it so),
        # held to commit. Taken by the producers (lock_keys), by an ordered done (lock_key_of)
        # and by an operator's skip (admin lock_keys_of_ids): a name that drifted in one of them
        # would let a message commit behind its key's moving head, and ordering would break
        # silently (DESIGN invariant 9).
        "key_lock": (
            "pg_advisory_xact_lock(hashtextextended("
            "'outbox_celery:key:' || %(table)s::regclass::oid::text || ':' || k, 0))"
        ),
        # The channel the table's listeners LISTEN on (Store.listen, notify_channel).
        "notify_channel": "'outbox_celery_' || %(table)s::regclass::oid::text",
        # Wakes the table's listeners at commit when %(notify)s is true; evaluated once per
        # statement (an init plan) and only when the statement returns a row.
        "wake_listeners": (
            "(SELECT CASE WHEN %(notify)s::bool THEN pg_notify({notify_channel}, '') IS NULL END)"
        ),
        # Every step of the finish statement, and those that never make a row done or dead
        # (invariant 29): lists generated from the one table of the steps (outcomes.STEPS).
        "steps": literals(r.step for r in STEPS),
        "steps_not_final": literals(NOT_FINAL),
        # A FROM item that sets synchronous_commit for the statement's own transaction to
        # %(commit_mode)s ('off' relaxes it; NULL keeps the session's setting): see Store's
        # relaxed_commit for why losing such a commit costs at most a redelivery.
        "commit_mode": (
            "(SELECT set_config('synchronous_commit',"
            " coalesce(%(commit_mode)s::text, current_setting('synchronous_commit')), true))"
            " AS commit_mode"
        ),
    }
)


@functools.cache
def read(name: str) -> str:
    """The text of ``sql/<name>`` inside the package."""
    return resources.files("outbox_celery.db").joinpath("sql", *name.split("/")).read_text(encoding="utf-8")


def _entries(filename: str) -> tuple[dict[str, str], dict[str, str]]:
    """``({name: text}, {fragment: text})`` of an annotated file, as written."""
    parts = _ENTRY.split(read(filename))
    # parts = [preamble, kind1, name1, body1, kind2, name2, body2, ...]
    found: dict[str, dict[str, str]] = {"name": {}, "fragment": {}}
    for kind, name, body in zip(parts[1::3], parts[2::3], parts[3::3], strict=True):
        text = body.strip().rstrip(";")
        if kind == "fragment":
            # A fragment's own comment explains it in the file; the statements need only its SQL.
            lines = text.splitlines()
            while lines and lines[0].lstrip().startswith("--"):
                lines.pop(0)
            text = "\n".join(lines)
        found[kind][name] = text
    return found["name"], found["fragment"]


def fill(text: str, fragments: Mapping[str, str] = FRAGMENTS) -> str:
    """``text`` with every ``{fragment}`` it names written in, fragments within fragments too
    (identifiers such as ``{table}`` stay placeholders for :func:`compose`)."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        return fill(fragments[name], fragments) if name in fragments else match.group(0)

    return _PLACEHOLDER.sub(one, text)


#: Fragments of one file that the statements of other files use too, by the file that holds
#: them: counting a group's outcomes is written once, beside the finalize (invariant 29), and
#: the operator's requeue and skip (admin.sql) run it as well; the key locks of an ordered done
#: are an operator's skip's too (invariant 9).
SHARED: Mapping[str, str] = MappingProxyType(
    {
        "group_settle": "queries.sql",
        "group_callback": "queries.sql",
        "group_callback_subs": "queries.sql",
        "lock_keys_of_rows": "queries.sql",
    }
)


@functools.cache
def fragments(filename: str) -> Mapping[str, str]:
    """The fragments the statements of ``sql/<filename>`` may use: :data:`FRAGMENTS`, the
    :data:`SHARED` ones and its own."""
    shared = {name: _entries(src)[1][name] for name, src in SHARED.items() if src != filename}
    return MappingProxyType({**FRAGMENTS, **shared, **_entries(filename)[1]})


@functools.cache
def named(filename: str) -> Mapping[str, str]:
    """Split a ``-- name: x`` annotated file into ``{x: text}``, fragments filled in."""
    statements, _local = _entries(filename)
    return MappingProxyType({name: fill(text, fragments(filename)) for name, text in statements.items()})


def compose(text: str, table: TableName) -> sql.Composed:
    """Bind the table (and its index names) as quoted identifiers into ``text``."""
    idents: dict[str, sql.Composable] = {
        "table": table.identifier(),
        # The table's identity (migration 0006): one row beside it, named after it.
        "instance_table": table.identifier(INSTANCE_SUFFIX),
        # Pause, RateLimited holds and rate buckets per event type (migration 0007).
        "flow_table": table.identifier(FLOW_SUFFIX),
        # Pause and RateLimited holds per limit key (migration 0008).
        "flow_key_table": table.identifier(FLOW_KEY_SUFFIX),
        "flow_key_held_idx": table.index_name(FLOW_KEY_SUFFIX + "_held_idx"),
        # The subscriptions producers fan out to (migration 0011).
        "subscription_table": table.identifier(SUBSCRIPTION_SUFFIX),
        # The keys' RateLimited holds by their end (migration 0009).
        "flow_key_until_idx": table.index_name(FLOW_KEY_SUFFIX + "_until_idx"),
        # Groups and their callbacks (migration 0012, invariant 29).
        "group_table": table.identifier(GROUP_SUFFIX),
        "group_open_idx": table.index_name(GROUP_SUFFIX + "_open_idx"),
    }
    idents.update({k: table.index_name(v) for k, v in {**INDEX_SUFFIXES, **INBOX_INDEX_SUFFIXES}.items()})
    used = {k: v for k, v in idents.items() if "{" + k + "}" in text}
    # SQL(...) marks the file text as trusted: it ships with the package, never user input.
    return sql.SQL(text).format(**used)


# A line that holds nothing but a comment. The files explain each statement there; a server
# running it needs none of that text.
_COMMENT_LINE = re.compile(r"^[ \t]*--[^\n]*(?:\n|\Z)", re.MULTILINE)


def bind(text: str, table: TableName, name: str) -> sql.Composed:
    """A named statement as it is run: ``text`` bound to ``table`` (:func:`compose`), its
    comment lines left out and a one-line tag in their place (``/* outbox-celery <name> */``,
    what ``pg_stat_statements`` and ``pg_stat_activity`` show), rendered once.

    A statement of identifiers composed with ``psycopg.sql`` is rendered again, each identifier
    quoted, on every execution; rendered here, an execution only encodes its text. Without the
    comments the statements stay under psycopg's cache of converted queries (texts of at most
    4,096 bytes), so their placeholders are not parsed again on every execution either.
    """
    body = _COMMENT_LINE.sub("", text)
    return sql.Composed([sql.SQL(f"/* outbox-celery {name} */ " + compose(body, table).as_string(None))])


#: Row sources of many rows (a fragment taking arrays) and their one-row forms (scalar
#: parameters). PostgreSQL cannot know an array parameter's length when it plans a prepared
#: statement once for all calls, so it plans a statement of arrays again for every call; the
#: one-row form of the same statement is planned once. One statement, one definition of its rules:
#: only the row source differs (:func:`one_row`).
ONE_ROW: Mapping[str, str] = MappingProxyType({"leases": "one_lease", "finishes": "one_finish"})


def one_row(filename: str, text: str) -> str | None:
    """``text`` (a filled statement of ``filename``) with its row sources of many rows in their
    one-row forms (:data:`ONE_ROW`); ``None`` when it has none."""
    known = fragments(filename)
    out = text
    for many, one in ONE_ROW.items():
        if many in known and one in known:
            out = out.replace(fill(known[many], known), fill(known[one], known))
    return None if out == text else out


def one_row_queries(
    filename: str, table: TableName, replaced: Mapping[str, str] | None = None
) -> Mapping[str, sql.Composed]:
    """The one-row forms (:func:`one_row`) of the statements of ``sql/<filename>`` that have
    one, bound to ``table``; ``replaced`` holds filled texts that replace named statements."""
    texts = {**named(filename), **(replaced or {})}
    return MappingProxyType(
        {
            name: bind(one, table, name)
            for name, text in texts.items()
            if (one := one_row(filename, text)) is not None
        }
    )


@functools.cache
def queries(filename: str, table: TableName) -> Mapping[str, sql.Composed]:
    """The named statements of ``sql/<filename>``, fragments filled, bound to ``table`` (cached)."""
    return MappingProxyType({name: bind(text, table, name) for name, text in named(filename).items()})
