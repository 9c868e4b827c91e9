"""Groups with a callback on real workers (DESIGN invariant 29).

Members and callbacks are ordinary deliveries (ordinary Celery tasks, as Flower shows them);
workers are SIGKILLed mid-group, and every group still ends closed with its callback enqueued
once and delivered; a dead member takes the group's declared path; a callback that starts the
next group runs a workflow of three steps.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest
from psycopg.rows import dict_row
from support.db import calls

from acceptance.conftest import Harness
from outbox_celery import Event, group

pytestmark = pytest.mark.slow

PART = "part.work"
DONE = "group.done"
STEP = "workflow.step"


def _groups(harness: Harness) -> list[dict[str, Any]]:
    with harness.conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(f"SELECT * FROM {harness.table}_group ORDER BY id").fetchall()


def _callbacks(harness: Harness, event_type: str = DONE) -> list[dict[str, Any]]:
    return [r for r in harness.rows() if r["event_type"] == event_type]


@pytest.mark.parametrize("broker_url", ["redis", "amqp"], indirect=True)
def test_invariant_29_groups_complete_once_while_workers_are_killed(harness: Harness) -> None:
    """20 groups of 10 members (a short run of the chaos suite's 200 x 50): one worker is
    SIGKILLed mid-run and replaced. Every group fires, each callback row exists once and its
    handler runs; a group with a permanent failure carries the dead member's error, one declared
    skip_on_dead is skipped."""
    harness.configure(lease=3.0, max_attempts=3, routes={PART: None, DONE: None})
    first = harness.worker(concurrency=2, name="first")
    harness.beat()
    n_groups, size = 20, 10
    with harness.conn.transaction():
        made = []
        for g in range(n_groups):
            parts = [
                Event(PART, {"mode": "permanent" if g >= 18 and i == 0 else "sleep", "seconds": 0.05}, "g", i)
                for i in range(size)
            ]
            then = Event(DONE, {"group": g}, "g", g)
            made.append(group(harness.conn, parts, then=then, skip_on_dead=g == 19, table=harness.table).id)
    harness.wait(
        lambda: len([c for c in calls(harness.conn) if c["event_type"] == PART]) > 40, what="progress"
    )
    first.kill()
    harness.worker(concurrency=2, name="second")
    harness.wait(
        lambda: all(g["state"] != "open" for g in _groups(harness)),
        what="every group closed",
    )
    groups = {g["id"]: g for g in _groups(harness)}
    assert [groups[i]["state"] for i in made] == ["fired"] * 19 + ["skipped"]
    callbacks = _callbacks(harness)
    # Committed once per group: one row each, the one its group row names.
    assert Counter(r["payload"]["outbox_group"]["id"] for r in callbacks) == Counter(made[:19])
    assert {r["id"] for r in callbacks} == {groups[i]["callback_id"] for i in made[:19]}
    harness.wait_finished(n_groups * size - 2 + 19)
    ran = Counter(
        c["outbox_id"] for c in calls(harness.conn) if c["event_type"] == DONE and c["result"] == "ok"
    )
    assert set(ran) == {r["id"] for r in callbacks}
    dead = next(r for r in callbacks if r["payload"]["group"] == 18)["payload"]["outbox_group"]
    assert (dead["done"], dead["dead"]) == (size - 1, 1)
    assert dead["dead_members"][0]["last_error"] == "PermanentError: scripted permanent failure"


def test_invariant_29_nested_groups_run_a_workflow_of_three_steps(harness: Harness) -> None:
    """Each step is a group's callback, handled transactionally: its done and the next step's
    group commit together, so a killed step leaves no half-started next step."""
    harness.configure(lease=3.0, routes={PART: None}, transactional={STEP: None})
    harness.worker(concurrency=2)
    harness.beat()
    payload = {"workflow_step": 1, "steps": 3, "members": 4, "member_type": PART}
    with harness.conn.transaction():
        parts = [Event(PART, {"step": 1, "i": i}, "workflow", i) for i in range(4)]
        group(harness.conn, parts, then=Event(STEP, payload, "workflow", 1), table=harness.table)
    harness.wait(
        lambda: [c["result"] for c in calls(harness.conn) if c["event_type"] == STEP] == ["ok"] * 3,
        what="three steps run",
    )
    time.sleep(1)  # nothing further comes
    steps = sorted(r["payload"]["workflow_step"] for r in _callbacks(harness, STEP))
    assert steps == [1, 2, 3]
    assert [g["state"] for g in _groups(harness)] == ["fired"] * 3
    assert len([r for r in harness.rows() if r["event_type"] == PART]) == 12
