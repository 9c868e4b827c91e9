"""The claim's planner, without a database (outbox_celery.claim.plan)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from outbox_celery.claim.executor import plan
from outbox_celery.claim.plan import FillRow, FlowRow, KeyedRow, KeyWalk, Seen
from outbox_celery.flow import CAP_RECHECK, LIMIT_RECHECK, Allowance, Limit

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _row(t: str, **kw: Any) -> FlowRow:
    base: dict[str, Any] = {
        "event_type": t,
        "paused": False,
        "held": False,
        "held_for": None,
        "tokens": None,
        "since_refill": None,
        "key_cursor": None,
        "at_cap": False,
    }
    return FlowRow(**{**base, **kw})


def test_invariant_25_no_limit_declared_and_nothing_held_plans_no_flow_statement() -> None:
    p = plan.plan_flow({}, Seen(now=NOW, known=frozenset({"a"}), held=frozenset({"a"})))
    assert (p.add, p.lock, p.clear_keys) == ((), (), ())
    read = plan.flow_read(p, Seen(now=NOW, held=frozenset({"a"}), held_for=3.0), (), {})
    assert read.held == {"a"} and read.held_for == 3.0 and read.allowances == {}


def test_the_flow_plan_adds_missing_rows_and_locks_in_one_order_with_held_keys_claimed_by_key() -> None:
    seen = Seen(now=NOW, known=frozenset({"b"}), key_types=("c",))
    p = plan.plan_flow({"b": Limit(concurrency=2), "a": Limit(rate=5)}, seen)
    assert p.lock == ("a", "b", "c")  # event-type order: concurrent claimers never deadlock
    assert p.add == ("a", "c")
    assert p.clear_keys == ("c",)
    assert p.limits["c"] == Limit()  # a held key alone: claimed key by key, no bound of its own


def test_invariant_22_allowances_from_the_locked_rows_and_live_counts() -> None:
    limits = {"conc": Limit(concurrency=5), "rate": Limit(rate=10), "paused": Limit(concurrency=1)}
    seen = Seen(now=NOW, known=frozenset(limits), held=frozenset({"other"}), held_for=9.0)
    p = plan.plan_flow(limits, seen)
    rows = [
        _row("conc", at_cap=True),
        _row("paused", paused=True),
        _row("rate", tokens=0.0, since_refill=0.15, key_cursor="k7"),
    ]
    held = plan.held_after_lock(p, seen, rows)
    assert held == {"other", "paused"}
    assert plan.to_count(p, held) == ("conc",)  # rate-only and held types are not counted
    read = plan.flow_read(p, seen, rows, {"conc": 3})
    assert read.allowances == {
        "conc": Allowance(rows=2, tokens=None, by_rate=False),
        "rate": Allowance(rows=1, tokens=1.5, by_rate=True),
    }
    assert read.held_for == 9.0 and read.cursors["rate"] == "k7" and read.at_cap["conc"]


def test_a_rate_hold_gives_the_earliest_wait_and_a_bucket_ahead_of_now_is_reclocked() -> None:
    limits = {"a": Limit(rate=1), "b": Limit(rate=1)}
    seen = Seen(now=NOW, known=frozenset(limits), held_for=30.0)
    rows = [_row("a", held=True, held_for=4.0), _row("b", tokens=1.0, since_refill=-plan.CLOCK_STEP - 1)]
    read = plan.flow_read(plan.plan_flow(limits, seen), seen, rows, {})
    assert read.held == {"a"} and read.held_for == 4.0
    assert read.reclock == {"b"} and read.allowances["b"].rows == 1


def test_key_walks_for_declared_key_limits_and_held_keys_only() -> None:
    limits = {"k": Limit(key_concurrency=1, key_rate=10), "held": Limit(), "plain": Limit(concurrency=3)}
    seen = Seen(now=NOW, key_types=("held",))
    read = plan.FlowRead(
        held=frozenset(),
        held_for=None,
        allowances={t: Allowance(5, None, False) for t in limits},
        cursors={"k": "x"},
    )
    walks = plan.keyed_walks(limits, read, seen)
    assert list(walks) == ["held", "k"]
    assert walks["k"] == KeyWalk(1, 10, 2.0, "x")
    assert walks["held"] == KeyWalk(None, None, None, None)


def _keyed(i: int | None, key: str, pos: int | None = None, **kw: Any) -> KeyedRow:
    claimed = i is not None
    return KeyedRow(
        id=i,
        lease_version=1 if claimed else None,
        event_type="k" if claimed else None,
        lease_until=NOW if claimed else None,
        available_at=NOW if claimed else None,
        limit_key=key,
        pos=pos,
        blocked=kw.get("blocked"),
        token_wait=kw.get("token_wait"),
        attempts=0 if claimed else None,
    )


def test_invariant_24_a_walk_stopped_by_its_room_resumes_after_the_last_key_served() -> None:
    walk = KeyWalk(1, None, None, "a")
    rows = [_keyed(1, "c", 2), _keyed(2, "b", 1), _keyed(None, "z", blocked=0)]
    after = walk.after(rows, room=2)
    assert after.cursor == "c" and after.moved and not after.blocked


def test_invariant_24_a_walk_with_room_left_resumes_after_the_last_key_walked() -> None:
    walk = KeyWalk(1, 2.0, 1.0, "a")
    rows = [_keyed(1, "c", 2), _keyed(None, "z", blocked=3, token_wait=0.4)]
    after = walk.after(rows, room=5)
    assert (after.cursor, after.moved, after.blocked, after.token_wait) == ("z", True, True, 0.4)
    again = after.after([_keyed(None, "z", token_wait=0.1)], room=5)
    assert again.cursor == "z" and again.moved and again.token_wait == 0.1  # moved this claim
    still = KeyWalk(1, None, None, "z").after([_keyed(None, "z")], room=5)
    assert not still.moved


def test_keys_walked_are_twice_the_room_within_bounds() -> None:
    walk = KeyWalk(1, None, None, None)
    assert walk.max_keys(room=10, batch=200) == plan.MIN_KEYS_WALKED
    assert walk.max_keys(room=100, batch=200) == 200
    assert walk.max_keys(room=5000, batch=5000) == plan.MAX_KEYS_WALKED
    assert walk.max_keys(room=100, batch=30) == 60  # never more than a batch's room


def test_invariant_21_a_batch_waits_to_fill_only_while_short_and_young() -> None:
    fill = {"a": (10, 2.0), "b": (10, 2.0), "c": (10, 2.0), "d": (10, 2.0), "e": (10, 0.0), "x": (10, 2.0)}
    assert plan.fill_asks(fill, 5, frozenset({"x"})) == {"a": 5, "b": 5, "c": 5, "d": 5}
    rows = [
        FillRow("a", 3, 0.5),  # short and young: waits 1.5 s more
        FillRow("b", 5, 0.5),  # as many as the claim's limit: claimed
        FillRow("c", 3, 2.5),  # waited max_wait: claimed
        FillRow("d", 0, None),  # nothing due
    ]
    assert plan.filling(fill, 5, rows) == {"a": 1.5}


def test_fresh_rows_share_the_batch_between_limited_types_and_the_rest() -> None:
    allowances = {"a": Allowance(100, None, False), "b": Allowance(10, None, False)}
    share, rooms = plan.fresh_rooms(allowances, {"a": 0, "b": 5}, 200)
    assert share == 66 and rooms == {"a": 66, "b": 5}
    assert plan.more_rooms(allowances, {"a": 66, "b": 5}, share, 100) == {"a": 34}
    assert plan.more_rooms(allowances, {"a": 66, "b": 5}, share, 0) == {}


def test_a_batch_smaller_than_the_limited_types_gives_the_first_types_one_row_each() -> None:
    allowances = {t: Allowance(9, None, False) for t in ("a", "b", "c", "d")}
    _share, rooms = plan.fresh_rooms(allowances, dict.fromkeys(allowances, 0), 2)
    assert rooms == {"a": 1, "b": 1, "c": 0, "d": 0}


def test_heads_take_the_rest_of_a_room_only_after_filling_their_share() -> None:
    rooms, shares = {"a": 10, "b": 10, "c": 10}, {"a": 5, "b": 5, "c": 5}
    got = {"a": 7, "b": 3, "c": 0}
    heads = {"a": 5, "b": 3}
    assert plan.heads_again(rooms, got, heads, shares) == {"a": 3}
    assert plan.half(1) == 1 and plan.half(7) == 4


def test_flow_wait_is_the_earliest_of_what_held_the_claim_back() -> None:
    limits = {"r": Limit(rate=2), "c": Limit(concurrency=1)}
    read = plan.FlowRead(
        held=frozenset(),
        held_for=9.0,
        allowances={"r": Allowance(1, 1.0, True), "c": Allowance(1, None, False)},
    )
    walks = {"k": KeyWalk(1, None, None, None, blocked=True, token_wait=0.01)}
    spent = {"r": 1, "c": 1}
    assert plan.flow_wait(read, limits, spent, walks, filling={"f": 0.3}, key_held_for=None) == LIMIT_RECHECK
    assert plan.flow_wait(read, limits, spent, {}, filling={}, key_held_for=5.0) == 0.5  # (1 - 0) / 2
    assert plan.flow_wait(read, limits, {"r": 0, "c": 1}, {}, filling={}, key_held_for=None) == CAP_RECHECK
    assert plan.flow_wait(None, {}, {}, {}, filling={}, key_held_for=1.0) is None  # no walk, no wait


def test_flow_writes_only_what_changed() -> None:
    limits = {
        "r": Limit(rate=2),
        "c": Limit(concurrency=1),
        "idle": Limit(rate=5),
        "k": Limit(key_concurrency=1),
    }
    read = plan.FlowRead(
        held=frozenset(),
        held_for=None,
        allowances={
            "r": Allowance(2, 2.0, True),
            "c": Allowance(1, None, False),
            "idle": Allowance(1, 1.0, True),
            "k": Allowance(9, None, False),
        },
        at_cap={"c": False, "k": True},
        reclock=frozenset(),
    )
    walks = {"k": KeyWalk(1, None, None, "q", moved=True, blocked=True)}
    writes = plan.flow_writes(read, limits, {"r": 1, "c": 1, "idle": 0, "k": 0}, walks)
    assert writes.cursors == (("k", "q"),)
    assert writes.buckets == (("r", 1.0),)  # an untouched bucket is not written (invariant 18)
    assert writes.at_cap == (("c", True),)  # k stays at cap: no write
    reclocked = plan.FlowRead(
        read.held, None, read.allowances, at_cap=read.at_cap, reclock=frozenset({"idle"})
    )
    assert ("idle", 1.0) in plan.flow_writes(
        reclocked, limits, {"r": 0, "c": 0, "idle": 0, "k": 0}, {}
    ).buckets
