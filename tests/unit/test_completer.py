"""The completer (``outbox_celery/complete.py``): each outcome's rule is written once, in the one
``finish`` statement, and every finalize of the package goes through :meth:`Completer.finish`.

Read from the query files and the source, and with a recording completer behind a real
:class:`Store` (no database: what is checked is where the calls go; what the statement writes is
checked against PostgreSQL in tests/integration/test_batch.py and test_finalize.py).
"""

from __future__ import annotations

import ast
import contextlib
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import outbox_celery
from outbox_celery.db import statements as _sql
from outbox_celery.db.completer import Completer, FinalizedMany, Finish, Lease, Step
from outbox_celery.db.store import Store
from outbox_celery.outcomes import NOT_FINAL

FILES = ["queries.sql", "admin.sql", "inbox/queries.sql"]
PACKAGE = Path(outbox_celery.__file__).parent
# The completer's statements: the fenced transitions of a claimed row.
FENCED = {"start", "resume", "start_exhausted", "finish", "finish_grouped", "extend_lease"}


def _statements() -> Iterator[tuple[str, str]]:
    """``("file:name", filled text)`` of every named statement of the package."""
    for filename in FILES:
        for name, text in _sql.named(filename).items():
            yield f"{filename}:{name}", text


def _holding(needle: str) -> set[str]:
    return {name for name, text in _statements() if needle in text}


# Each outcome's rule, by a piece of SQL only that rule writes.
RULES = {
    # retry: dead once attempts are spent, saying so.
    "retry exhausted": "'attempts exhausted ('",
    # defer and rate_limited: dead past max_defer_age.
    "dead past max_defer_age": _sql.fill("{past_max_defer_age}", _sql.fragments("queries.sql")),
    "past max_defer_age text": "' past max_defer_age: '",
    # defer, rate_limited and postpone: the attempt refunded.
    "attempt refunded": "greatest(o.attempts - 1, 0)",
    # done: the row finished.
    "done written": "done_at = CASE WHEN f.outcome = 'done' THEN now()",
    # error: the row left to its lease.
    "error keeps the lease": "lease_until = CASE WHEN f.outcome = 'error' THEN o.lease_until END",
    # release: only a claim that never started.
    "release unstarted only": "f.outcome <> 'release' OR o.started_version < o.lease_version",
}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_each_outcome_rule_is_written_in_exactly_one_named_statement(rule: str) -> None:
    # finish_grouped is finish's update (the one fragment finish_update) with a group's count
    # after it (DESIGN invariant 29); the rule is written once in the file.
    assert _holding(RULES[rule]) == {"queries.sql:finish", "queries.sql:finish_grouped"}, rule
    assert _sql.read("queries.sql").count(RULES[rule]) == 1, rule


def test_the_max_defer_age_rule_is_written_once_in_the_files() -> None:
    raw = "".join(_sql.read(f) for f in FILES)
    assert raw.count("%(max_age)s") == 1  # the fragment past_max_defer_age, used by finish only
    assert raw.count("past max_defer_age: ") == 1


def test_the_finish_statement_handles_every_step_and_nothing_else() -> None:
    text = _sql.named("queries.sql")["finish"]
    [listed] = re.findall(r"AND f\.outcome IN \(('[a-z_]+'(?:, '[a-z_]+')*)\)", text)
    assert {s.strip("'") for s in listed.split(", ")} == {str(s) for s in Step}
    # No other statement compares an outcome: the steps are decided in finish alone (and in
    # finish_grouped, which is finish's update with a group's count after it).
    assert _holding("f.outcome") == {"queries.sql:finish", "queries.sql:finish_grouped"}


def test_the_plain_finish_writes_a_member_s_steps_that_are_never_final_and_no_other() -> None:
    # finish leaves a group's member alone (finish_grouped counts it), but for the steps that
    # never make a row done or dead (invariant 29): those the completer sends to finish
    # whatever the row. The steps are those finish_update's status rule never makes final.
    text = _sql.named("queries.sql")["finish"]
    [listed] = re.findall(r"o\.group_id IS NULL OR f\.outcome IN \(('[a-z_]+'(?:, '[a-z_]+')*)\)", text)
    assert {s.strip("'") for s in listed.split(", ")} == {str(s) for s in NOT_FINAL}
    status_rule = text.split("SET status = CASE", 1)[1].split(" END,", 1)[0]
    final = {
        name
        for when in re.findall(r"WHEN (.*?) THEN ('dead'|f\.outcome)\n", status_rule)
        for name in re.findall(r"'([a-z_]+)'", when[0])
    }
    assert final == {"done", "dead", "retry", "defer", "rate_limited"}
    assert {str(s) for s in Step} - final == {str(s) for s in NOT_FINAL}


def test_the_fenced_row_sources_are_used_by_the_completer_statements_only() -> None:
    known = _sql.fragments("queries.sql")
    fenced = set()
    for source in _sql.ONE_ROW:
        fenced |= _holding(_sql.fill(known[source], known))
    assert fenced == {f"queries.sql:{n}" for n in FENCED}
    # A one-row form exists for each, and differs from it only in its row source.
    one = _sql.one_row_queries("queries.sql", Store("t").table)
    assert set(one) == FENCED
    for name in FENCED:
        text = _sql.named("queries.sql")[name]
        single = _sql.one_row("queries.sql", text)
        assert single is not None and single != text
        for many, row in _sql.ONE_ROW.items():
            single = single.replace(_sql.fill(known[row], known), _sql.fill(known[many], known))
        assert single == text, name


def test_no_statement_is_fenced_on_one_lease_but_through_the_row_sources() -> None:
    # "%(lease_version)s" is the one-row form's parameter: a statement that used it directly
    # would be a second, hand-written fenced write.
    for filename in FILES:
        raw = _sql.read(filename)
        assert raw.count("%(lease_version)s") == (2 if filename == "queries.sql" else 0), filename


def _query_names(path: Path) -> set[str]:
    """Statement names a module runs: ``x._q["name"]``, ``x._one["name"]``, ``self._query("name", ...)``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr in ("_q", "_one")
            and isinstance(node.slice, ast.Constant)
        ):
            names.add(str(node.slice.value))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "_query"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names.add(str(node.args[0].value))
    return names


def test_only_the_completer_runs_the_fenced_statements() -> None:
    runners = {
        path.stem
        for path in PACKAGE.rglob("*.py")
        if _query_names(path) & (FENCED | {"lock_key_of", "flow_hold", "payloads"})
    }
    assert runners == {"completer"}


# One claim or one step of a row per call: the test helpers' (tests/support/steps.py), never the
# store's or the worker's (they go through executor.claim and the completer).
PER_STEP = frozenset(
    [
        "claim",
        "start",
        "start_many",
        "done",
        "done_many",
        "finish_many",
        "retry",
        "defer",
        "rate_limited",
        "dead",
        "record_error",
        "postpone",
        "extend_lease",
        "extend_leases",
    ]
)


def test_the_worker_writes_through_one_call_per_step_into_the_completer() -> None:
    """Every write of the worker's rooms is a completer call in fence.py: start, finish, extend."""
    calls: dict[str, list[str]] = {}
    for path in sorted((PACKAGE / "worker").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Attribute)
                and node.func.value.attr in ("store", "completer")
            ):
                calls.setdefault(f"{node.func.value.attr}.{node.func.attr}", []).append(path.stem)
    on_completer = {k: sorted(v) for k, v in calls.items() if k.startswith("completer.")}
    assert on_completer == {
        "completer.extend": ["fence"],
        "completer.finish": ["fence"],
        "completer.start": ["fence"],
    }
    assert {k.split(".")[1] for k in calls if k.startswith("store.")} & PER_STEP == set()


class _Recorder(Completer):
    """A completer that records what it is asked to finish, and wins every fence."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.calls: list[tuple[list[Finish], dict[str, Any]]] = []

    def finish(self, conn: Any, finishes: Sequence[Finish], **kw: Any) -> FinalizedMany:
        self.calls.append((list(finishes), kw))
        return FinalizedMany({f.lease.id: "processing" for f in finishes}, frozenset())  # type: ignore[misc]


class _Conn:
    def transaction(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def test_the_store_writes_no_step_itself() -> None:
    """The fenced transitions are the completer's: the store keeps no per-step method, and its
    one write of claims (the release of unpublished rows) is one call of the completer."""
    assert PER_STEP & set(dir(Store)) == set()
    store = Store("t")
    recorder = store.completer = _Recorder(store)
    assert store.release(_Conn(), [Lease(1, 2), Lease(3, 4)]) == 2  # type: ignore[arg-type]
    [(finishes, kw)] = recorder.calls
    assert [(f.lease, f.step) for f in finishes] == [(Lease(1, 2), Step.RELEASE), (Lease(3, 4), Step.RELEASE)]
    assert kw == {"max_attempts": 0, "max_age": 0.0}
