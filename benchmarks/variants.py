"""Benchmark-only variants, clearly labelled, to measure a change beside what it replaced.

Nothing here is used by the library. A variant spec is a comma-separated list of names:

* ``explicit_tx``: ``BEGIN``/``COMMIT`` around the fenced start and every finalizer (as the legacy
  store does).
* ``durable``: the fenced start and ``done`` commit with ``synchronous_commit`` on
  (``Store(relaxed_commit=False)``).
* ``claim_jit``: the claim transaction leaves ``jit`` at the server's setting (the legacy store
  does; on a large table the ordered heads' query then pays for JIT compilation on every claim).
* ``legacy``: the three above: the legacy store (explicit transactions, durable commits, JIT on).
* ``skip_scan``: the ordered claim as a recursive skip scan that probes every key with
  unfinished messages on every claim (the baseline of the claim benchmark's keys dimension).
* ``acks_early``: the delivery task acknowledges its message when the worker receives it
  instead of after it ran (``acks_late=False``); a worker lost mid-task then leaves the row to
  come back through its lease, as it does anyway. Measured only: the library keeps acks late.
* ``publish_each``: the claim publishes every task on its own (one Redis round trip and one
  Redis client per task) instead of one pipelined batch per claim batch, and Celery
  computes each task's ``argsrepr``.
* ``bound_each_run``: every claim run recounts the adaptive in-flight bound (the default reuses
  one computed within the last second).
* ``check_each``: the pool checks every connection with a round trip before handing it out
  (the default checks only connections idle for ``POOL_CHECK_IDLE`` seconds, and a
  fenced write that meets a broken one is retried on a checked one).
* ``done_each``: every ``done`` is written at once, in its own statement
  (``done_batch_delay=0``; the default batches them).
* ``unbatched`` (also spelled ``before-12``, the name recorded runs use): all four of the
  above (the claim and delivery paths without their batching and reuse).
* ``no_slot_wake``: a concurrency-limited event type's finish goes through the done batcher
  and wakes nobody (no freed-slot wake): the claim finds the slot at its next
  ``LIMIT_RECHECK``.
* ``expired_each``: every claim runs its expired-lease scans (``release_expired``, ``reap``,
  ``claim_expired``) whether or not a lease ran out, each walking the lease index from the
  expired mark (from its start on a full pass), as before ``first_expired`` (invariant 18).
* ``fenced_status``: the fenced start, resume, finish and lease heartbeat test
  ``status = 'processing'`` as before, which lets the planner read them from the whole lease
  index (a bitmap scan) once autoanalyze has counted few processing rows: under a pinned
  horizon that index holds every claim's and start's dead entry since the pin.
* ``index_sampler``: the horizon benchmark counts the unfinished rows as its first
  measurements did, from the whole pending and lease indexes every second (benchmark side
  only: see ``benchmarks.horizon.UnfinishedCounter``).
* ``push_broker``: the listener sends the claim task through the broker on every wake-up
  instead of running the claim in the worker's main process. Measured only: the library claims
  in-process.
"""

from __future__ import annotations

import contextlib
from typing import Any

import psycopg

from outbox_celery import Store, TableName
from outbox_celery.db import statements as _sql

__all__ = ["ExplicitTransactionStore", "apply", "make_store", "parse"]

ALIASES = {
    "legacy": ("explicit_tx", "durable", "claim_jit"),
    "unbatched": ("publish_each", "bound_each_run", "check_each", "done_each"),
}
ALIASES["before-12"] = ALIASES["unbatched"]
KNOWN = {
    "explicit_tx",
    "durable",
    "claim_jit",
    "acks_early",
    "skip_scan",
    "push_broker",
    "publish_each",
    "bound_each_run",
    "check_each",
    "done_each",
    "no_slot_wake",
    "expired_each",
    "index_sampler",
    "fenced_status",
}

#: The fenced statements whose status test ``fenced_status`` writes as before.
FENCED = ("start", "resume", "start_exhausted", "finish", "extend_lease")

# Benchmark-only: first_expired (and the first statement's probe of it) as if a lease always ran
# out at the mark (the epoch on a full pass: every expired scan runs from the mark or from the
# start of the lease index, as before first_expired).
EXPIRED_EACH_FIRST = "coalesce(%(expired_since)s::timestamptz, 'epoch'::timestamptz)"

# Benchmark-only: the claim_heads query as a recursive skip scan (it ignores the head flag).
SKIP_SCAN_CLAIM_HEADS = """
WITH RECURSIVE heads AS (
    (SELECT ordering_key, id FROM {table}
     WHERE ordering_key IS NOT NULL AND status <> 'done'
     ORDER BY ordering_key, id
     LIMIT 1)
    UNION ALL
    SELECT nxt.ordering_key, nxt.id
    FROM heads,
    LATERAL (
        SELECT ordering_key, id FROM {table}
        WHERE ordering_key > heads.ordering_key AND ordering_key IS NOT NULL AND status <> 'done'
        ORDER BY ordering_key, id
        LIMIT 1
    ) AS nxt
),
picked AS (
    SELECT o.id FROM {table} AS o
    JOIN heads ON heads.id = o.id
    WHERE o.status = 'pending' AND o.available_at <= now()
      AND (%(event_types)s::text[] IS NULL OR o.event_type = ANY(%(event_types)s::text[]))
    ORDER BY o.available_at, o.id
    LIMIT %(limit)s
    FOR UPDATE OF o SKIP LOCKED
)
{claim_picked}
"""


class ExplicitTransactionStore(Store):
    """Benchmark-only: every fenced statement wrapped in ``BEGIN``/``COMMIT`` (the legacy store)."""

    def _single_statement(self, conn: psycopg.Connection[Any]) -> contextlib.AbstractContextManager[Any]:
        return conn.transaction()


def parse(spec: str) -> set[str]:
    """The set of variant names in ``spec`` (aliases expanded); raise on unknown names."""
    names: set[str] = set()
    for name in filter(None, (s.strip() for s in spec.split(","))):
        expanded = ALIASES.get(name, (name,))
        unknown = set(expanded) - KNOWN
        if unknown:
            raise ValueError(f"unknown benchmark variant(s) {sorted(unknown)}")
        names.update(expanded)
    return names


def make_store(table: str | TableName, spec: str) -> Store:
    """A store with the variants of ``spec`` applied."""
    names = parse(spec)
    cls = ExplicitTransactionStore if "explicit_tx" in names else Store
    named = _sql.named("queries.sql")
    queries: dict[str, str] = {}
    if "claim_jit" in names:
        # Benchmark-only: the claim transaction's first statement no longer turns JIT off (its
        # claim lock and probes stay).
        for name in ("claim_settings", "claim_settings_flow"):
            queries[name] = named[name].replace("set_config('jit', 'off', true)", "NULL")
    if "skip_scan" in names:
        queries["claim_heads"] = SKIP_SCAN_CLAIM_HEADS
    if "expired_each" in names:
        queries["first_expired"] = f"SELECT {EXPIRED_EACH_FIRST} AS lease_until"
        fragments = _sql.fragments("queries.sql")
        probe = "(" + _sql.fill(fragments["first_expired_scan"], fragments) + ")"
        for name in ("claim_settings", "claim_settings_flow"):
            queries[name] = queries.get(name, named[name]).replace(probe, EXPIRED_EACH_FIRST)
    if "fenced_status" in names:
        for name in FENCED:
            queries[name] = named[name].replace(
                "status IS NOT DISTINCT FROM 'processing'", "status = 'processing'"
            )
    return cls(table, relaxed_commit="durable" not in names, queries=queries)


def outbox_store(table: str | TableName, spec: str) -> Store | None:
    """The store an ``Outbox(store=...)`` takes for the variants of ``spec``; None: the default."""
    if parse(spec) & {"explicit_tx", "durable", "claim_jit", "expired_each", "fenced_status"}:
        return make_store(table, spec)
    return None


def apply(outbox: Any, spec: str) -> None:
    """Patch one benchmark process's ``Outbox`` (workers) to use the variants of ``spec``."""
    names = parse(spec)
    if "publish_each" in names:
        from outbox_celery.app import publisher

        @contextlib.contextmanager
        def each(producer: Any, n: int) -> Any:
            yield False  # Benchmark-only: every task published on its own, not pipelined.

        publisher._publish_batch = each
        deliver = outbox.deliver_task
        apply_async = deliver.apply_async

        def with_repr(*args: Any, **kw: Any) -> Any:
            kw.pop("argsrepr", None)  # Benchmark-only: Celery's own repr of the arguments.
            kw.pop("kwargsrepr", None)
            return apply_async(*args, **kw)

        deliver.apply_async = with_repr
    if "bound_each_run" in names:
        from outbox_celery.worker import deliverer as dispatch

        dispatch.BOUND_REFRESH = 0.0  # Benchmark-only: recount the bound on every claim run.
    if "check_each" in names:
        outbox._idle_check.after = 0.0  # Benchmark-only: a round trip on every checkout.
    if "done_each" in names:
        # Benchmark-only: no batched done, each written by its delivery.
        outbox._settings["done_batch_delay"] = 0.0
        outbox._config = None
    if "no_slot_wake" in names:
        from outbox_celery import flow
        from outbox_celery.db import store
        from outbox_celery.worker import deliverer as dispatch

        # Benchmark-only: a freed slot waits for the claim's next LIMIT_RECHECK (the recheck at a
        # limit was LIMIT_RECHECK then; it is CAP_RECHECK since finishes wake the claim).
        dispatch.Dispatcher._wakes_claim = lambda self, spec: False  # type: ignore[method-assign]
        flow.CAP_RECHECK = flow.LIMIT_RECHECK
        setattr(store, "CAP_RECHECK", flow.LIMIT_RECHECK)  # noqa: B010 - imported by name there
    if "acks_early" in names:
        outbox.deliver_task.acks_late = False
    if "push_broker" in names:
        from outbox_celery.app import push

        make_listener = push.listener_for

        def via_broker(ob: Any) -> Any:
            listener = make_listener(ob)
            cfg = ob.config

            def send() -> None:
                # Benchmark-only: one claim task per wake-up, through the broker.
                ob.claim_task.apply_async(queue=cfg.claim_queue, expires=cfg.claim_interval)

            listener.claim = send
            return listener

        push.listener_for = via_broker
