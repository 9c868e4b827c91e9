"""The one table of the outcomes (``outbox_celery/outcomes.py``): every rule about a step or an
outcome is written there once, and the rest of the package, the SQL included, derives from it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import outbox_celery
from outbox_celery import outcomes
from outbox_celery.db import statements as _sql
from outbox_celery.db.completer import Finish, Lease
from outbox_celery.message import Message
from outbox_celery.outcomes import NOT_FINAL, STEPS, Outcome, Step
from outbox_celery.worker.verdict import Verdict

PACKAGE = Path(outbox_celery.__file__).parent
TABLE_MODULE = PACKAGE / "outcomes.py"
SQL_DIR = PACKAGE / "db" / "sql"

# The get_stats() keys (docs/operations.md): renaming one breaks users' dashboards.
COUNTERS = {
    Outcome.DONE: "done",
    Outcome.RETRY: "retried",
    Outcome.DEFER: "deferred",
    Outcome.DEAD: "dead",
    Outcome.ERROR: "errors",
    Outcome.STALE: "stale_starts",
    Outcome.LOST_LEASE: "lost_leases",
    Outcome.UNROUTABLE: "unroutable",
    Outcome.RATE_LIMITED: "rate_limited",
    Outcome.HANDED_BACK: "handed_back",
}


def test_every_step_has_exactly_one_row() -> None:
    assert [r.step for r in STEPS] == list(Step)


@pytest.mark.parametrize("outcome", list(Outcome))
def test_each_outcome_keeps_its_documented_counter(outcome: Outcome) -> None:
    assert outcome.counter == COUNTERS[outcome]


def test_the_steps_count_under_the_documented_counters() -> None:
    counted = {r.step: r.counter for r in STEPS}
    assert counted == {
        Step.DONE: "done",
        Step.RETRY: "retried",
        Step.DEFER: "deferred",
        Step.RATE_LIMITED: "rate_limited",
        Step.DEAD: "dead",
        Step.ERROR: "errors",
        Step.POSTPONE: None,
        Step.RELEASE: "released",
        Step.HAND_BACK: "handed_back",
    }
    # A step's counter is its verdict's outcome's counter.
    assert all(r.counter == r.outcome.counter for r in STEPS if r.outcome and r.counter)


def test_the_steps_that_are_never_final() -> None:
    assert set(NOT_FINAL) == {Step.ERROR, Step.POSTPONE, Step.RELEASE, Step.HAND_BACK}


@pytest.mark.parametrize("row", STEPS, ids=lambda r: str(r.step))
def test_a_verdict_writes_the_step_of_its_outcome(row: outcomes.Row) -> None:
    if row.outcome is None:
        return
    msg = Message(1, "t", "a", "1", {}, 1, None, 7, None, "k")  # type: ignore[arg-type]
    finish = Verdict(row.outcome, delay=2.0, error="e").finish(msg)
    assert finish == Finish(Lease(1, 7), row.step, 2.0, "e", ordered=False, grouped=False)


def test_the_verdicts_that_write_no_step() -> None:
    assert {o for o in Outcome if o not in {r.outcome for r in STEPS}} == {Outcome.STALE, Outcome.LOST_LEASE}


def test_a_write_is_named_after_its_steps() -> None:
    assert outcomes.operation([Step.DONE]) == "finish_done"
    assert outcomes.operation([Step.ERROR, Step.ERROR]) == "record_error"
    assert outcomes.operation([Step.DONE, Step.RETRY]) == "finish"


def _keyed_by_the_vocabulary(node: ast.expr | None) -> bool:
    """``Step.X`` or ``Outcome.X`` (what a second table of the outcomes would be keyed by)."""
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in ("Step", "Outcome")
    )


def test_no_other_module_keeps_a_table_of_steps_or_outcomes() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == TABLE_MODULE:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Dict) and any(_keyed_by_the_vocabulary(k) for k in node.keys):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} (a mapping)")
            if (
                isinstance(node, ast.Set)
                and sum(
                    isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "Step"
                    for e in node.elts
                )
                > 1
            ):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} (a set of steps)")
    assert found == []


_LIST = re.compile(r"\(\s*('[a-z_]+'(?:\s*,\s*'[a-z_]+')+)\s*\)")


def _lists(text: str) -> list[set[str]]:
    """The sets of quoted words written as ``('a', 'b', ...)`` in ``text``."""
    return [set(re.findall(r"'([a-z_]+)'", m.group(1))) for m in _LIST.finditer(text)]


def test_no_sql_file_writes_a_list_of_steps_by_hand() -> None:
    every = {str(r.step) for r in STEPS}
    derived = [every, {str(s) for s in NOT_FINAL}, {str(r.step) for r in STEPS if r.final}]
    files = sorted(SQL_DIR.rglob("*.sql"))
    assert len(files) > 10  # the migrations too
    for path in files:
        written = _lists(path.read_text(encoding="utf-8"))
        assert [s for s in written if s in derived] == [], path.name


def test_the_finish_statements_take_their_lists_of_steps_from_the_table() -> None:
    raw = _sql.read("queries.sql")
    assert raw.count("f.outcome IN ({steps})") == 1  # finish_update, in finish and finish_grouped
    assert raw.count("f.outcome IN ({steps_not_final})") == 1  # the plain finish's group guard
    finish = _sql.named("queries.sql")["finish"]
    assert {str(r.step) for r in STEPS} in _lists(finish)
    assert {str(s) for s in NOT_FINAL} in _lists(finish)
    assert {str(r.step) for r in STEPS} in _lists(_sql.named("queries.sql")["finish_grouped"])
