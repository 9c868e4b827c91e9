"""The Celery app the acceptance tests run in real workers, and its scripted handler.

A test describes the app with an :class:`AppSpec` (DSN, broker, outbox settings, event type ->
queue routes, extra Celery settings); :meth:`AppSpec.env` turns it into the environment of a
``celery -A support.worker_app`` subprocess, which rebuilds the same app with
:func:`build_app`. The test process can build the very same app in-process (to publish by hand,
run a claim, inspect routing).

Every handler is :func:`scripted`: what it does is written in the message's payload, so one
worker serves every situation a test needs::

    {"mode": "ok"}                          return (delivered)
    {"mode": "retry", "times": 2}           RetryableError on attempts 1-2, then ok
    {"mode": "retry", "delay": 3600}        RetryableError(delay=3600) on every attempt
    {"mode": "permanent"}                   PermanentError
    {"mode": "defer", "delay": 3600}        Defer(3600)
    {"mode": "error"}                       an unclassified RuntimeError
    {"mode": "kill", "times": 1}            SIGKILL its own process on attempt 1, then ok
    {"mode": "sleep", "seconds": 0.5}       sleep, then ok
    {"mode": "stall"}                       on attempt 1, wait until another run finished the
                                            row under a newer lease, then return (a late,
                                            fenced finalize)
    {"mode": "extend", "seconds": 30}       extend its own lease, record whether it won
    {"mode": "rate_limited", "retry_after": 3}
                                            RateLimited(3) on the message's first run, then ok
    {"mode": "leak"}                        (transactional) leave session state on the handler's
                                            connection: SET app.tenant, SET synchronous_commit,
                                            LISTEN, a WITH HOLD cursor, an advisory lock, and
                                            (unless "python_side": false) a text loader, dict rows
    {"mode": "probe"}                       (transactional) return what the handler's connection
                                            holds of that state (PROBE), as the call's result
    {"for": {"receipt": {"mode": "permanent"}}}
                                            what the subscription "receipt"'s run does instead

Event types in ``transactional`` get :func:`scripted_transactional` instead: the same
modes, run inside the handler's transaction after it wrote its effect (a row in ``effects``)
and, when the payload names one in ``follow_up``, enqueued a follow-up event; ``stall`` polls on
the transaction's own connection (so the transaction is never idle for long).

Event types in ``batches`` get :func:`scripted_batch`, a batch handler: each message of
the list does what its payload says, in id order; ``retry``, ``defer`` and ``permanent`` become
its entry in the returned mapping, ``error`` and ``kill`` end the whole batch. Its calls record
the batch (``batch_first``, ``batch_size``).

Each run inserts a row into ``handler_calls`` before acting (so a run that kills its process is
still seen) and stamps ``finished_at``/``result`` when it returns or raises. Celery's
``task_retry`` and ``task_failure`` signals are recorded into ``celery_signals`` by the worker
module.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import kombu.utils.json
import psycopg
from celery import Celery, current_task
from psycopg import sql
from psycopg.adapt import Loader
from psycopg.rows import dict_row

from outbox_celery import (
    Defer,
    Event,
    Message,
    PermanentError,
    RateLimited,
    RetryableError,
    Store,
    TableName,
    enqueue_group,
)
from outbox_celery.app.outbox import Outbox

ENV_VAR = "OUTBOX_TEST_APP"

CALLS_DDL = """
CREATE TABLE IF NOT EXISTS handler_calls (
    n             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    outbox_id     bigint      NOT NULL,
    event_type    text        NOT NULL,
    attempts      integer     NOT NULL,
    lease_version bigint      NOT NULL,
    idempotency_key text      NOT NULL,
    payload_type  text        NOT NULL,
    payload_json  text        NOT NULL,
    pid           integer     NOT NULL,
    hostname      text,
    routing_key   text,
    in_flight     integer,
    batch_first   bigint,
    batch_size    integer,
    started_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    finished_at   timestamptz,
    result        text
);
CREATE TABLE IF NOT EXISTS effects (
    n             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    outbox_id     bigint      NOT NULL,
    lease_version bigint      NOT NULL,
    attempts      integer     NOT NULL,
    ordering_key  text,
    pid           integer     NOT NULL,
    at            timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS celery_signals (
    n         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    signal    text        NOT NULL,
    task_name text,
    task_id   text,
    pid       integer     NOT NULL,
    detail    text,
    at        timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""

# How long a "stall" handler waits for the newer run before giving up (a test bound, not a
# behaviour under test).
STALL_LIMIT = 60.0


@dataclass
class AppSpec:
    """Everything the test app is built from; travels to workers as JSON in ``OUTBOX_TEST_APP``.

    :ivar dsn: the test database.
    :ivar broker_url: the Celery broker.
    :ivar outbox: keyword arguments of :class:`~outbox_celery.app.outbox.Outbox`
        (``lease``, ``claim_interval``, ``claim_queue``...).
    :ivar routes: event type -> queue (``None``: the outbox's default queue); one scripted
        handler is registered per event type.
    :ivar transactional: event type -> queue of the transactional handlers
        (:func:`scripted_transactional`).
    :ivar batches: event type -> batch size of the batch handlers (:func:`scripted_batch`, on
        the outbox's default queue).
    :ivar transactional_kind: what they ask for: ``"psycopg"`` (the outbox's pool),
        ``"sqlalchemy"`` (a ``sessionmaker`` on the test database) or ``"django"`` (the worker
        module configures Django on the test database).
    :ivar celery: extra Celery settings, loaded with ``config_from_object`` as a user would.
    :ivar via_celery_conf: give the outbox settings as ``outbox_*`` Celery settings instead of
        keyword arguments.
    :ivar queries: replacement texts of named queries (``Store(queries=...)``), to make the
        library itself fail where a test needs it to.
    :ivar limits: event type -> keyword arguments of its handler's flow-control limits
        (``{"concurrency": 2, "rate": "5/s"}``), or of a batch handler's ``max_wait``.
    """

    dsn: str
    broker_url: str
    outbox: dict[str, Any] = field(default_factory=dict)
    routes: dict[str, str | None] = field(default_factory=dict)
    transactional: dict[str, str | None] = field(default_factory=dict)
    batches: dict[str, int] = field(default_factory=dict)
    transactional_kind: str = "psycopg"
    celery: dict[str, Any] = field(default_factory=dict)
    via_celery_conf: bool = False
    queries: dict[str, str] = field(default_factory=dict)
    limits: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: event type -> {subscription name -> queue} of named scripted handlers (invariant 28);
    #: ``limits`` is keyed by route (``<event_type>@<name>``) for them.
    subscriptions: dict[str, dict[str, str | None]] = field(default_factory=dict)

    def to_json(self) -> str:
        """The spec as JSON."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> AppSpec:
        """Inverse of :meth:`to_json`."""
        return cls(**json.loads(text))

    @classmethod
    def from_env(cls) -> AppSpec:
        """The spec a test put in this process's environment."""
        text = os.environ.get(ENV_VAR)
        if not text:
            raise RuntimeError(f"{ENV_VAR} is not set: this module is started by the acceptance tests")
        return cls.from_json(text)

    def env(self) -> dict[str, str]:
        """Environment variables that carry this spec to a worker or beat process."""
        return {ENV_VAR: self.to_json()}

    @property
    def table(self) -> str:
        """The outbox table of this app."""
        return str(self.outbox.get("table", "outbox"))


def build_app(spec: AppSpec) -> tuple[Celery, Outbox]:
    """A Celery app and its outbox, configured the way a user's project module would be."""
    app = Celery("outbox_acceptance", broker=spec.broker_url, set_as_current=False)
    store = Store(spec.table, queries=spec.queries) if spec.queries else None
    conf: dict[str, Any] = {
        "broker_connection_retry_on_startup": True,
        "worker_hijack_root_logger": True,
        # No remote control (pidbox) traffic between the tests' workers; it also keeps a solo
        # worker on RabbitMQ from stalling at "Stopping Control" during warm shutdown.
        "worker_enable_remote_control": False,
        "task_default_queue": f"{spec.outbox.get('default_queue', 'outbox')}.celery",
        **spec.celery,
    }
    if spec.via_celery_conf:
        conf.update({f"outbox_{k}": v for k, v in spec.outbox.items()})
        app.config_from_object(conf)
        outbox = Outbox(app, dsn=spec.dsn, store=store)
    else:
        app.config_from_object(conf)
        outbox = Outbox(app, dsn=spec.dsn, store=store, **spec.outbox)
    for event_type, queue in spec.routes.items():
        outbox.handler(event_type, queue=queue, **spec.limits.get(event_type, {}))(scripted(outbox))
    for event_type, names in spec.subscriptions.items():
        for name, queue in names.items():
            route = f"{event_type}@{name}"
            outbox.handler(event_type, name=name, queue=queue, **spec.limits.get(route, {}))(scripted(outbox))
    options: dict[str, Any] = {"transactional": spec.transactional_kind}
    if spec.transactional and spec.transactional_kind == "sqlalchemy":
        from sqlalchemy import create_engine
        from sqlalchemy.orm import sessionmaker

        dsn = spec.dsn
        engine = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(dsn), pool_size=2)
        options["session_factory"] = sessionmaker(engine)
    for event_type, queue in spec.transactional.items():
        outbox.handler(event_type, queue=queue, **options)(scripted_transactional(outbox))
    for event_type, size in spec.batches.items():
        outbox.handler(event_type, batch=size, **spec.limits.get(event_type, {}))(scripted_batch(outbox))
    return app, outbox


def create_tables(conn: psycopg.Connection[Any]) -> None:
    """Create ``handler_calls`` and ``celery_signals`` (before any worker starts)."""
    conn.execute(CALLS_DDL)


def scripted(outbox: Outbox) -> Any:
    """The handler every test event type uses: it does what its payload says."""

    def handler(message: Message) -> None:
        payload = message.payload if isinstance(message.payload, dict) else {}
        # {"for": {"<subscription>": {...}}}: what one subscription's handler does differently.
        payload = {**payload, **payload.get("for", {}).get(message.subscription or "", {})}
        mode = str(payload.get("mode", "ok"))
        times = payload.get("times")
        active = times is None or message.attempts <= int(times)
        call = _record_start(outbox, message)
        try:
            result = _act(outbox, message, mode if active else "ok", payload)
        except BaseException as exc:
            _record_end(outbox, call, f"raised {type(exc).__name__}")
            raise
        _record_end(outbox, call, result)

    handler.__name__ = "scripted_handler"
    return handler


def scripted_batch(outbox: Outbox) -> Any:
    """The batch handler: every message does what its payload says, in id order."""

    def handler(messages: list[Message]) -> dict[int, BaseException] | None:
        first, size = messages[0].id, len(messages)
        failed: dict[int, BaseException] = {}
        for message in messages:
            payload = message.payload if isinstance(message.payload, dict) else {}
            mode = str(payload.get("mode", "ok"))
            times = payload.get("times")
            active = times is None or message.attempts <= int(times)
            call = _record_start(outbox, message, batch=(first, size))
            try:
                result = _act(outbox, message, mode if active else "ok", payload)
            except (RetryableError, Defer, PermanentError) as exc:
                _record_end(outbox, call, f"returned {type(exc).__name__}")
                failed[message.id] = exc
                continue
            except BaseException as exc:
                _record_end(outbox, call, f"raised {type(exc).__name__}")
                raise
            _record_end(outbox, call, result)
        return failed or None

    handler.__name__ = "scripted_batch_handler"
    return handler


def scripted_transactional(outbox: Outbox) -> Any:
    """The transactional handler: effect, optional follow-up, then what the payload says."""

    def handler(message: Message, conn: Any) -> None:
        payload = message.payload if isinstance(message.payload, dict) else {}
        mode = str(payload.get("mode", "ok"))
        times = payload.get("times")
        active = times is None or message.attempts <= int(times)
        call = _record_start(outbox, message)  # on a connection of its own: kept on rollback
        try:
            # Each kind writes the effect its own way: psycopg, the Session, Django's cursor.
            raw, producer = _write_effect(conn, message)
            follow_up = payload.get("follow_up")
            if "workflow_step" in payload:
                _next_step(outbox, message, producer, payload)
            if follow_up:
                outbox.enqueue(
                    producer,
                    event_type=str(follow_up),
                    payload={"after": message.id},
                    aggregate_type="effect",
                    aggregate_id=str(message.id),
                )
            if active and mode == "stall":
                result = _stall(outbox, message, raw)
            elif mode == "leak":
                leave_state(raw, python_side=bool(payload.get("python_side", True)))
                result = "left state"
            elif mode == "probe":
                result = repr(raw.execute(PROBE).fetchone())
            else:
                result = _act(outbox, message, mode if active else "ok", payload)
        except BaseException as exc:
            _record_end(outbox, call, f"raised {type(exc).__name__}")
            raise
        _record_end(outbox, call, result)

    handler.__name__ = "scripted_transactional_handler"
    return handler


def _next_step(outbox: Outbox, message: Message, producer: Any, payload: dict[str, Any]) -> None:
    """A workflow's step (a group's callback, DESIGN invariant 29): unless it is the last, start
    the next step's group, whose callback is the next step, in this handler's transaction."""
    step, steps = int(payload["workflow_step"]), int(payload.get("steps", 3))
    if step >= steps:
        return
    member = str(payload.get("member_type", "thing.happened"))
    n = int(payload.get("members", 3))
    then = {k: v for k, v in payload.items() if k != "outbox_group"} | {"workflow_step": step + 1}
    enqueue_group(
        producer,
        [Event(member, {"step": step + 1, "i": i}, "workflow", i) for i in range(n)],
        then=Event(message.event_type, then, "workflow", step + 1),
        table=outbox.config.table,
    )


# What a transactional handler's connection holds of the state a "leak" run leaves; a fresh
# session's answer is CLEAN_PROBE (tuple rows, no text loader, nothing set, no cursor, no LISTEN).
PROBE = (
    "SELECT nullif(current_setting('app.tenant', true), ''), current_setting('synchronous_commit'),"
    " (SELECT count(*) FROM pg_cursors)::int + (SELECT count(*) FROM pg_listening_channels())::int"
    " + (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = 4242)::int"
)
CLEAN_PROBE = repr((None, "on", 0))


class _Shout(Loader):
    """A text loader a "leak" handler registers on its connection."""

    def load(self, data: Any) -> str:
        return bytes(data).decode().upper()


def leave_state(raw: psycopg.Connection[Any], *, python_side: bool = True) -> None:
    """Everything a handler can leave on its connection (the "leak" mode); with
    ``python_side``, on the psycopg object too (a text loader, dict rows)."""
    raw.execute("SET app.tenant = '42'")
    raw.execute("SET synchronous_commit = off")
    raw.execute("LISTEN outbox_leak")
    raw.execute("DECLARE leak CURSOR WITH HOLD FOR SELECT 1")
    raw.execute("SELECT pg_advisory_lock(4242)")
    if python_side:
        raw.adapters.register_loader("text", _Shout)
        raw.row_factory = dict_row  # type: ignore[assignment]


EFFECT = (
    "INSERT INTO effects (outbox_id, lease_version, attempts, ordering_key, pid)"
    " VALUES (%(id)s, %(version)s, %(attempts)s, %(key)s, %(pid)s)"
)


def _write_effect(conn: Any, message: Message) -> tuple[psycopg.Connection[Any], Any]:
    """Insert the effect through ``conn``; return the psycopg connection under it and what
    ``enqueue`` takes."""
    params = {
        "id": message.id,
        "version": message.lease_version,
        "attempts": message.attempts,
        "key": message.ordering_key,
        "pid": os.getpid(),
    }
    if isinstance(conn, psycopg.Connection):
        conn.execute(EFFECT, params)
        return conn, conn
    if type(conn).__module__.startswith("sqlalchemy"):
        from sqlalchemy import text

        conn.execute(text(EFFECT.replace("%(", ":").replace(")s", "")), params)
        return conn.connection().connection.driver_connection, conn
    with conn.cursor() as cur:  # Django's connection wrapper
        cur.execute(EFFECT, params)
    return conn.connection, conn.connection


def _act(outbox: Outbox, message: Message, mode: str, payload: dict[str, Any]) -> str:
    if mode == "ok":
        return "ok"
    if mode == "retry":
        delay = payload.get("delay")
        raise RetryableError(f"scripted retry on attempt {message.attempts}", delay=delay)
    if mode == "permanent":
        raise PermanentError("scripted permanent failure")
    if mode == "defer":
        raise Defer(float(payload.get("delay", 60)), reason="scripted defer")
    if mode == "error":
        raise RuntimeError("scripted unexpected error")
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)  # pragma: no cover - the signal is delivered first
        return "survived"
    if mode == "sleep":
        time.sleep(float(payload.get("seconds", 0.5)))
        return "ok"
    if mode == "rate_limited":
        # Only the message's first run (its attempt is refunded, so attempts cannot tell).
        with outbox.connection() as conn:
            row = conn.execute("SELECT count(*) FROM handler_calls WHERE outbox_id = %s", [message.id])
            runs = row.fetchone()
        if runs is not None and int(runs[0]) <= 1:
            raise RateLimited(float(payload.get("retry_after", 3)), reason="scripted HTTP 429")
        return "ok"
    if mode == "stall":
        return _stall(outbox, message)
    if mode == "extend":
        won = message.extend_lease(float(payload.get("seconds", 30)))
        return f"extended={won}"
    raise ValueError(f"unknown scripted mode {mode!r}")


def _stall(outbox: Outbox, message: Message, tx: psycopg.Connection[Any] | None = None) -> str:
    """Outlive the lease: wait until a newer claim of this row has finished it.

    With ``tx`` (a transactional handler's connection, read committed) it polls there.
    """
    query = sql.SQL("SELECT status, lease_version FROM {} WHERE id = %s").format(
        TableName.parse(outbox.config.table).identifier()
    )
    deadline = time.monotonic() + STALL_LIMIT
    while time.monotonic() < deadline:
        if tx is not None:
            row = tx.execute(query, [message.id]).fetchone()
        else:
            with outbox.connection() as conn:
                row = conn.execute(query, [message.id]).fetchone()
        if row and row[0] == "done" and int(row[1]) > message.lease_version:
            return "stalled past a newer run"
        time.sleep(0.1)
    return "stall timed out"


def _record_start(outbox: Outbox, message: Message, batch: tuple[int, int] | None = None) -> int:
    request = getattr(current_task, "request", None)
    hostname = getattr(request, "hostname", None)
    delivery = getattr(request, "delivery_info", None) or {}
    in_flight = sql.SQL("(SELECT count(*) FROM {} WHERE status = 'processing')").format(
        TableName.parse(outbox.config.table).identifier()
    )
    query = sql.SQL(
        "INSERT INTO handler_calls (outbox_id, event_type, attempts, lease_version, idempotency_key,"
        " payload_type, payload_json, pid, hostname, routing_key, in_flight, batch_first, batch_size)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, {}, %s, %s) RETURNING n"
    ).format(in_flight)
    with outbox.connection() as conn:
        row = conn.execute(
            query,
            [
                message.id,
                message.route,  # the event type, or <event_type>@<subscription>
                message.attempts,
                message.lease_version,
                message.idempotency_key,
                # What the handler was given, type included: a str must not arrive as a dict.
                # Written as Celery's JSON (kombu's), which carries Decimal, datetime, UUID...
                type(message.payload).__name__,
                kombu.utils.json.dumps(message.payload),
                os.getpid(),
                hostname,
                delivery.get("routing_key"),
                batch[0] if batch else None,
                batch[1] if batch else None,
            ],
        ).fetchone()
    assert row is not None
    return int(row[0])


def _record_end(outbox: Outbox, call: int, result: str) -> None:
    with outbox.connection() as conn:
        conn.execute(
            "UPDATE handler_calls SET finished_at = clock_timestamp(), result = %s WHERE n = %s",
            [result, call],
        )


def record_signal(outbox: Outbox, name: str, task_name: str | None, task_id: str | None, detail: str) -> None:
    """Write one Celery signal occurrence into ``celery_signals``."""
    with outbox.connection() as conn:
        conn.execute(
            "INSERT INTO celery_signals (signal, task_name, task_id, pid, detail)"
            " VALUES (%s, %s, %s, %s, %s)",
            [name, task_name, task_id, os.getpid(), detail[:2000]],
        )
