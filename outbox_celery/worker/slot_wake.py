"""Waking the claim when a delivery frees a slot of a concurrency-limited type (invariant 22).

:class:`SlotWake` decides whether a finished delivery's ``done`` is written at once and
announced on the table's channel (docs/flow-control.md), rather than held by the done batcher.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import psycopg

from ..config import OutboxConfig
from ..db.store import SLOT_FREED, Store
from ..errors import first_line
from ..flow import AT_CAP_TTL, Limit
from ..handlers import HandlerSpec
from .fence import Connections

__all__ = ["SlotWake"]

logger = logging.getLogger(__name__)


def _bounds_live(limit: Limit) -> bool:
    """Whether a limit bounds live deliveries (``concurrency`` or ``key_concurrency``): a finish
    of its type may free a slot the claim waits for."""
    return limit.concurrency is not None or limit.key_concurrency is not None


class SlotWake:
    """The slot-freeing wake of one worker process."""

    def __init__(
        self, config: OutboxConfig, connection: Connections, store: Store, handlers: Mapping[str, HandlerSpec]
    ) -> None:
        self.config = config
        self.connection = connection
        self.store = store
        self.handlers = handlers
        # The concurrency-limited types the last claim left at their limit, and when this
        # process read that (monotonic; read again after AT_CAP_TTL).
        self._capped: tuple[float, frozenset[str]] = (-float("inf"), frozenset())

    def wakes_claim(self, spec: HandlerSpec) -> bool:
        """Whether a finished delivery of ``spec``'s type frees a slot the claim waits for.

        True for a concurrency-limited type that the last claim left at its limit, or with a
        limit key at its ``key_concurrency`` (its flow row's ``at_cap``, read at most every
        :data:`AT_CAP_TTL` by this process): its finalize is written at once (never held by the
        done batcher) and then notifies the table's channel with :data:`SLOT_FREED`; a push
        listener held back by a limit claims at once and hands the slot out, not
        ``CAP_RECHECK`` later. Below its limit the done stays batched: nobody waits for the slot.
        """
        if not (self.config.listen and spec.limit is not None and _bounds_live(spec.limit)):
            return False
        return spec.event_type in self._capped_types()

    def _capped_types(self) -> frozenset[str]:
        read_at, capped = self._capped
        now = time.monotonic()
        if now - read_at < AT_CAP_TTL:
            return capped
        bounded = sorted(t for t, s in self.handlers.items() if s.limit is not None and _bounds_live(s.limit))
        try:
            with self.connection() as conn:
                capped = self.store.capped(conn, bounded)
        except psycopg.Error as exc:  # the slot is then found by CAP_RECHECK: nothing is lost
            logger.warning("outbox: reading the limited types' state failed (%s)", first_line(exc))
            capped = frozenset()
        self._capped = (now, capped)
        return capped

    def wake(self) -> None:
        """Notify the table's channel that a slot is free; a failure costs a ``CAP_RECHECK``."""
        try:
            with self.connection() as conn:
                self.store.notify(conn, SLOT_FREED)
        except psycopg.Error as exc:
            logger.warning("outbox: waking the claim failed (%s)", first_line(exc))
