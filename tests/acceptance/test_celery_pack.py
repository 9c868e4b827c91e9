"""Packs in real workers (DESIGN invariant 30), made to happen.

A handler declared with ``pack=8`` and 16 events committed together: the claim sends them as
two pack tasks (their size in the task's name), each one fenced start and then every handler in
turn. One message kills its pool process on its first run, mid-pack: every row comes back
through its lease and is delivered; the killer's attempt counted, the rows of its pack it never
reached charged that one attempt and no more (they travel alone afterwards), none dead.
"""

from __future__ import annotations

from collections import Counter

import pytest
from support.db import calls

from acceptance.conftest import HarnessFactory

pytestmark = pytest.mark.slow

EVENT = "metrics.sample"
LEASE = 6.0


def test_invariant_30_a_pool_process_killed_mid_pack_loses_nothing_and_costs_its_neighbours_one_attempt(
    harness_factory: HarnessFactory, redis_url: str
) -> None:
    harness = harness_factory(redis_url)
    harness.configure(routes={EVENT: None}, limits={EVENT: {"pack": 8}}, lease=LEASE)
    killer = 3
    ids = harness.enqueue(
        16, event_type=EVENT, payload=lambda i: {"mode": "kill", "times": 1} if i == killer else {}
    )
    worker = harness.worker(concurrency=1)
    harness.beat()
    harness.wait_finished(len(ids), timeout=LEASE + 90)
    rows = {r["id"]: r for r in harness.rows()}
    assert {r["status"] for r in rows.values()} == {"done"}
    # Two packs of eight, one task each.
    assert f"deliver[{EVENT}][8]" in worker.log()
    runs = Counter(c["outbox_id"] for c in calls(harness.conn))
    assert set(runs) == set(ids)  # every message's handler ran
    assert rows[ids[killer]]["attempts"] == 2  # the run that killed its process counted
    # No row paid more than that one attempt for the kill; none went dead.
    assert max(r["attempts"] for r in rows.values()) == 2
    assert all(n <= 2 for n in runs.values())
    # The killed pack (the first eight, in claim order) came back through its lease under a new
    # claim, each row alone, from the killer on (the rows before it: as their held done was
    # written before the kill or not); the other pack finished under its first claim.
    final = {c["outbox_id"]: c["lease_version"] for c in calls(harness.conn)}
    assert all(final[i] == 2 for i in ids[killer:8])
    assert all(final[i] in (1, 2) for i in ids[:killer])
    assert all(final[i] == 1 for i in ids[8:])
