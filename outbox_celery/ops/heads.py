"""Ordering keys without a head, given their head back (``outbox-celery repair-heads``).

A key's unfinished message flagged ``head`` is the one the claim hands out (DESIGN invariant 9);
a key whose unfinished messages carry no flag is never claimed. A producer or worker of a
release before migration 0004, still running after it, leaves such keys; ``stats`` counts them.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import psycopg

from ..errors import AdminError
from ..message import KEY_SEPARATOR
from ..table import TableName
from ._queries import many, outside_transaction, q, regclass, values

__all__ = ["repair_heads"]

logger = logging.getLogger(__name__)


class _Settled(NamedTuple):
    """A row of ``settle_heads``: the message flagged as its key's head."""

    id: int
    ordering_key: str


def repair_heads(
    conn: psycopg.Connection[Any], table: str | TableName, *, batch_size: int = 500
) -> list[str]:
    """Give every ordering key without a head its head back; return the keys mended.

    A key whose unfinished messages carry no ``head`` flag is never claimed: a producer
    or worker of a release before migration 0004, still running after it, leaves such keys.
    Each batch of at most ``batch_size`` keys is its own transaction that takes the keys'
    producer locks (sorted, as producers do) and flags the lowest unfinished message of each key
    still without a head (DESIGN invariant 9), so it is safe while producers and workers run.
    ``conn`` must not be inside a transaction. Idempotent: a second run mends nothing.
    """
    outside_transaction(conn, "repair_heads")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise AdminError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    t = TableName.parse(table)
    table_regclass = regclass(conn, t)
    mended: list[str] = []
    after = ""
    while True:
        keys = [str(k) for k in values(conn, q(t, "headless_keys"), {"after": after, "limit": batch_size})]
        if not keys:
            break
        with conn.transaction():
            # A subscription's stored key takes its producer's key lock (DESIGN invariant 28).
            locks = [k.partition(KEY_SEPARATOR)[0] for k in keys]
            conn.execute(q(t, "lock_keys"), {"table": table_regclass, "keys": locks})
            settled = many(conn, q(t, "settle_heads"), {"keys": keys}, _Settled)
            mended += sorted(str(r.ordering_key) for r in settled)
        if len(keys) < batch_size:
            break
        after = keys[-1]
    if mended:
        logger.warning(
            "outbox repair: %s ordering key(s) had no head; their lowest unfinished message is "
            "the head again",
            len(mended),
            extra={"outcome": "heads_repaired", "keys": len(mended), "outbox_table": str(t)},
        )
    return mended
