"""What one delivery task carries: a claim batch cut into publish units (invariants 21, 30)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ..handlers import HandlerSpec

if TYPE_CHECKING:
    from .executor import Claimed

__all__ = ["publish_units"]


def publish_units(
    claims: Sequence[Claimed], handlers: Mapping[str, HandlerSpec], *, max_attempts: int
) -> list[list[Claimed]]:
    """The delivery tasks of a claim batch: one claim each, a batch handler's batch, or a pack.

    Claims of a batch handler's route are cut into consecutive groups of at most its ``batch``,
    in claim order. The claims of a route whose handler declares ``pack`` that have spent no
    attempt are cut into as few packs as its ``pack`` allows, of even sizes (invariant 30);
    every other claim is a group of one. The one definition of what a delivery task carries:
    the claim loop orders its rows by it (so that rows after a failed publish are exactly the
    ones not sent) and the publisher sends one task per group. Grouping its own output again
    gives the same groups. A claim holds at most one row per ordering key (only heads are
    claimable), so neither does a group (DESIGN invariant 21).

    :param max_attempts: the outbox's; below 2 nothing is packed: a pack's start spends an
        attempt of each row it carries, and a row may not spend its only one on a neighbour's
        crash.
    """
    packs = max_attempts >= 2
    units: list[list[Claimed]] = []
    filling: dict[str, list[Claimed]] = {}
    packable: dict[str, list[Claimed]] = {}
    for claim in claims:
        spec = handlers.get(claim.event_type)
        if spec is not None and spec.batch:
            unit = filling.get(claim.event_type)
            if unit is None or len(unit) >= spec.batch:
                unit = filling[claim.event_type] = []
                units.append(unit)
            unit.append(claim)
        elif packs and spec is not None and spec.pack > 1 and claim.attempts == 0:
            packable.setdefault(claim.event_type, []).append(claim)
        else:
            units.append([claim])
    for event_type, rows in packable.items():
        n = -(-len(rows) // handlers[event_type].pack)
        units.extend(rows[i * len(rows) // n : (i + 1) * len(rows) // n] for i in range(n))
    return units
