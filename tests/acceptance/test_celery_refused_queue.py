"""A route whose queue the app does not declare holds back only its own rows.

With ``task_create_missing_queues`` off, Celery refuses to route a task to a queue missing from
``task_queues`` (``QueueNotFound``): a configuration fault of that route alone. The claim gives
its rows back (nothing spent), leaves the route out of its claims for ``unroutable_delay`` and
publishes every other route; the broker's own failures still stop the run (invariant 12).
"""

from __future__ import annotations

import pytest
from support.db import rows, statuses

from acceptance.conftest import DEFAULT_EVENT, HarnessFactory

pytestmark = pytest.mark.slow


def test_an_undeclared_queue_holds_back_its_own_route_only(
    harness_factory: HarnessFactory, broker_url: str
) -> None:
    h = harness_factory(broker_url)
    ghost = h.q("ghost")  # routed to, never declared
    declared = [h.claim_queue, h.default_queue, f"{h.default_queue}.celery"]
    h.configure(
        routes={DEFAULT_EVENT: None, "ghost.happened": ghost},
        celery={
            "task_create_missing_queues": False,
            "task_queues": {q: {"exchange": q, "routing_key": q} for q in declared},
        },
        unroutable_delay=3600,
    )
    ghosts = h.enqueue(5, event_type="ghost.happened")
    others = h.enqueue(300)
    h.worker(queues=declared)
    h.beat()
    h.wait(lambda: statuses(h.conn, h.table).get("done", 0) == len(others), 120, "every other row done")
    # Given back, nothing spent. Each process that claims (the main process's push, the pool
    # processes' beat claims) leaves the route out once it saw its refusal: the rows settle.
    settled = [("pending", 0)] * len(ghosts)

    def ghost_rows() -> list[tuple[str, int]]:
        by_id = {r["id"]: r for r in rows(h.conn, h.table)}
        return [(by_id[i]["status"], by_id[i]["attempts"]) for i in ghosts]

    h.wait(lambda: ghost_rows() == settled, 30, "the refused rows back in pending")
    assert statuses(h.conn, h.table)["done"] == len(others)
    h.procs.started[0].wait_for_log("the app refused to route the tasks of 'ghost.happened'")
