"""Configuring an Outbox in a Celery app: outbox_* settings, validation, worker settings, routing.

In-process (no worker needed) except the last test, which starts a real worker with a bad
setting and expects it to refuse to start.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
import pytest
from celery import Celery
from support.apps import AppSpec
from support.db import row
from support.processes import CeleryProcesses

from outbox_celery import ConfigurationError, enqueue
from outbox_celery.app.outbox import Outbox

MEMORY = "memory://"


def make_app(
    conf: dict[str, Any] | None = None, *, broker: str = MEMORY, namespace: str | None = None
) -> Celery:
    """A Celery app configured the usual way: ``config_from_object`` before first use."""
    app = Celery("cfg_test", broker=broker, set_as_current=False)
    if conf is not None:
        app.config_from_object(conf, namespace=namespace)
    return app


def route_of(app: Celery, task_name: str) -> str:
    """The queue Celery's router picks for ``task_name`` when the caller names none."""
    route = app.amqp.router.route({}, task_name, (), {})
    return str(route["queue"].name)


# -- outbox_* settings ---------------------------------------------------------------------------


def test_settings_come_from_celery_outbox_keys_and_keyword_arguments_win() -> None:
    app = make_app(
        {
            "outbox_dsn": "postgresql://u@db/app",
            "outbox_table": "events.outbox",
            "outbox_lease": 45,
            "outbox_claim_interval": 0.25,
            "outbox_max_attempts": 4,
            "outbox_claim_queue": "cq",
            "outbox_default_queue": "dq",
        }
    )
    outbox = Outbox(app, max_attempts=7)
    cfg = outbox.config
    assert cfg.dsn == "postgresql://u@db/app"
    assert cfg.table.qualified == "events.outbox"
    assert cfg.lease == 45.0
    assert cfg.claim_interval == 0.25
    assert cfg.claim_queue == "cq" and cfg.default_queue == "dq"
    assert cfg.max_attempts == 7  # the keyword argument wins over outbox_max_attempts
    entry = app.conf.beat_schedule["outbox-claim"]
    assert entry["task"] == "outbox.claim"
    assert entry["schedule"] == 0.25
    soft, hard = cfg.claim_time_limits
    assert entry["options"] == {
        "queue": "cq",
        "expires": 0.25 + cfg.max_clock_skew,
        "soft_time_limit": soft,
        "time_limit": hard,
    }
    assert (outbox.claim_task.soft_time_limit, outbox.claim_task.time_limit) == (soft, hard)


def test_settings_with_a_celery_namespace_django_style() -> None:
    class Settings:
        CELERY_OUTBOX_LEASE = 30
        CELERY_OUTBOX_CLAIM_QUEUE = "claims"

    app = make_app(Settings, namespace="CELERY")  # type: ignore[arg-type]
    outbox = Outbox(app, dsn="postgresql://u@db/app")
    assert outbox.config.lease == 30.0
    assert outbox.config.claim_queue == "claims"


def test_timedelta_settings_and_sub_second_claim_interval() -> None:
    app = make_app({})
    outbox = Outbox(app, lease=timedelta(seconds=5), claim_interval=timedelta(milliseconds=200))
    assert outbox.config.lease == 5.0
    assert app.conf.beat_schedule["outbox-claim"]["schedule"] == 0.2


def test_two_outboxes_in_one_app_get_their_own_tasks_and_beat_entries() -> None:
    app = make_app({})
    a = Outbox(app, name="orders_outbox", table="orders_outbox", claim_queue="a.claim")
    b = Outbox(app, name="billing_outbox", table="billing_outbox", claim_queue="b.claim")
    assert a.claim_task.name == "orders_outbox.claim" and b.claim_task.name == "billing_outbox.claim"
    schedule = app.conf.beat_schedule
    assert schedule["orders_outbox-claim"]["options"]["queue"] == "a.claim"
    assert schedule["billing_outbox-claim"]["options"]["queue"] == "b.claim"


# -- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        {"lease": -1},
        {"lease": 0},
        {"lease": "60"},
        {"claim_interval": 90},  # not shorter than the default 60 s lease
        {"max_attempts": 0},
        {"batch_size": 1.5},
        {"table": 'bad"name'},
        {"table": "a.b.c"},
        {"claim_queue": ""},
        {"backoff_base": 10, "backoff_cap": 1},
        {"no_such_setting": 1},
    ],
)
def test_bad_keyword_settings_raise_configuration_error(settings: dict[str, Any]) -> None:
    app = make_app({})
    app.conf.beat_schedule  # noqa: B018 - the app is configured: errors surface in Outbox()
    with pytest.raises(ConfigurationError):
        Outbox(app, **settings)


def test_bad_celery_setting_raises_when_the_configuration_loads() -> None:
    # The usual order: app, outbox, then the first use of the configuration (a worker or beat
    # starting). The error must surface there, not be swallowed and leave beat without claims.
    app = make_app({"outbox_lease": -5})
    Outbox(app)
    with pytest.raises(ConfigurationError, match="lease"):
        app.conf.beat_schedule  # noqa: B018


def test_bad_keyword_setting_raises_when_the_configuration_loads() -> None:
    app = make_app({"outbox_lease": 30})
    Outbox(app, claim_interval=45)  # only wrong together with the Celery setting
    with pytest.raises(ConfigurationError, match="claim_interval"):
        app.conf.beat_schedule  # noqa: B018


def test_handler_registration_is_checked() -> None:
    outbox = Outbox(make_app({}))

    @outbox.handler("order.created", queue="orders")
    def first(message: Any) -> None: ...

    with pytest.raises(ConfigurationError):
        outbox.handler("order.created")(first)
    with pytest.raises(ConfigurationError):
        outbox.handler("")
    assert outbox.queue_for("order.created") == "orders"
    assert outbox.queue_for("anything.else") == "outbox"
    assert outbox.queues == ["outbox.claim", "outbox", "orders"]


# -- worker settings -----------------------------------------------------------------------------


def test_recommended_worker_settings_are_applied_where_unset() -> None:
    app = make_app({}, broker="redis://127.0.0.1:1/0")
    Outbox(app, lease=120)
    assert app.conf.worker_prefetch_multiplier == 1
    assert app.conf.broker_transport_options["visibility_timeout"] > 120
    # Socket timeouts go to the claim's own publishing connection, not to every consumer.
    assert "socket_timeout" not in app.conf.broker_transport_options
    delivery = app.tasks["outbox.deliver"]
    assert delivery.acks_late is True
    assert delivery.max_retries == 0


def test_settings_the_user_chose_are_kept() -> None:
    app = make_app(
        {
            "worker_prefetch_multiplier": 2,
            "broker_transport_options": {"visibility_timeout": 7200, "socket_timeout": 3},
        },
        broker="redis://127.0.0.1:1/0",
    )
    Outbox(app, lease=60)
    assert app.conf.worker_prefetch_multiplier == 2
    assert app.conf.broker_transport_options == {"visibility_timeout": 7200, "socket_timeout": 3}


def test_settings_set_on_app_conf_before_configuration_are_kept() -> None:
    app = Celery("cfg_test", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.worker_prefetch_multiplier = 3
    Outbox(app)
    assert app.conf.worker_prefetch_multiplier == 3


def test_user_transport_options_get_a_visibility_timeout_added() -> None:
    app = make_app({"broker_transport_options": {"socket_timeout": 3}}, broker="redis://127.0.0.1:1/0")
    Outbox(app, lease=60)
    assert app.conf.broker_transport_options["socket_timeout"] == 3
    assert app.conf.broker_transport_options["visibility_timeout"] > 60


def test_no_redis_options_on_rabbitmq_and_nothing_applied_when_told_not_to() -> None:
    app = make_app({}, broker="amqp://guest:guest@127.0.0.1:1//")
    Outbox(app)
    assert "visibility_timeout" not in (app.conf.broker_transport_options or {})
    untouched = make_app({}, broker="redis://127.0.0.1:1/0")
    Outbox(untouched, configure_celery=False)
    assert untouched.conf.worker_prefetch_multiplier == 4
    assert "visibility_timeout" not in (untouched.conf.broker_transport_options or {})


def test_check_worker_settings_flags_bad_settings() -> None:
    app = make_app(
        {"worker_prefetch_multiplier": 8, "task_time_limit": 120},
        broker="redis://127.0.0.1:1/0",
    )
    outbox = Outbox(app, lease=60)
    assert app.conf.worker_prefetch_multiplier == 8  # the configuration is loaded
    # Changed after configuration (a visibility timeout too short is refused at start-up).
    app.conf.broker_transport_options = {"visibility_timeout": 30}
    problems = outbox.check_worker_settings()
    assert len(problems) == 3, problems
    assert any("worker_prefetch_multiplier=8" in p for p in problems)
    assert any("visibility_timeout=30" in p for p in problems)
    assert any("task_time_limit=120" in p for p in problems)


def test_invariant_2_the_redis_visibility_timeout_set_covers_the_handler_time_limit_and_a_lease() -> None:
    # With lease_heartbeat a handler may run for handler_time_limit; Redis hands
    # its unacked task to another worker after visibility_timeout. Before, the library set
    # max(3600, 4 x lease) whatever the handler's limit.
    app = make_app({}, broker="redis://127.0.0.1:1/0")
    Outbox(app, lease=300, lease_heartbeat=True, handler_time_limit=7200)
    assert app.conf.broker_transport_options["visibility_timeout"] > 7200 + 300
    plain = make_app({}, broker="redis://127.0.0.1:1/0")
    Outbox(plain, lease=60)
    assert plain.conf.broker_transport_options["visibility_timeout"] == 3600


@pytest.mark.parametrize("configure_celery", [True, False])
def test_invariant_2_a_visibility_timeout_below_the_handler_time_limit_and_a_lease_stops_the_start(
    configure_celery: bool,
) -> None:
    # Chosen by the user (or kombu's default of 3600 s, left alone with configure_celery=False):
    # refused when the configuration loads, so worker and beat stop with this message.
    conf = {"broker_transport_options": {"visibility_timeout": 3600}} if configure_celery else {}
    app = make_app(conf, broker="redis://127.0.0.1:1/0")
    with pytest.raises(ConfigurationError, match=r"visibility_timeout=3600.*handler_time_limit"):
        Outbox(
            app, lease=300, lease_heartbeat=True, handler_time_limit=7200, configure_celery=configure_celery
        )
        _ = app.conf.broker_transport_options
    # Below the lease alone is refused too.
    low = make_app({"broker_transport_options": {"visibility_timeout": 30}}, broker="redis://127.0.0.1:1/0")
    with pytest.raises(ConfigurationError, match="visibility_timeout=30"):
        Outbox(low, lease=60)
        _ = low.conf.broker_transport_options


def test_check_worker_settings_is_quiet_on_recommended_settings() -> None:
    app = make_app({}, broker="redis://127.0.0.1:1/0")
    assert Outbox(app, lease=60).check_worker_settings() == []


@pytest.mark.parametrize(
    ("pool", "expected"),
    [
        ("solo", ["does not enforce task time limits", "start it with -c 1"]),
        ("threads", ["does not enforce task time limits", "pool_max_size=4"]),
        ("eventlet", ["does not enforce task time limits", "pool_max_size=4"]),
        ("gevent", ["pool_max_size=4"]),
        ("celery.concurrency.thread:TaskPool", ["does not enforce task time limits", "pool_max_size=4"]),
    ],
)
def test_check_worker_settings_flags_pools_that_do_not_fit(pool: str, expected: list[str]) -> None:
    app = make_app({}, broker="redis://127.0.0.1:1/0")
    outbox = Outbox(app, lease=60, pool_max_size=4)
    problems = outbox.check_worker_settings(pool=pool, concurrency=8)
    assert len(problems) == len(expected), problems
    for text, problem in zip(expected, problems, strict=True):
        assert text in problem
    # Concurrency that fits: only the time-limit caveat (if any) remains.
    fitting = outbox.check_worker_settings(pool=pool, concurrency=1)
    assert len(fitting) == len(expected) - 1, fitting
    # A worker on the claim queue alone runs no handler: nothing to say about its pool.
    assert outbox.check_worker_settings(pool=pool, concurrency=8, queues=["outbox.claim"]) == []
    assert len(
        outbox.check_worker_settings(pool=pool, concurrency=8, queues=["outbox.claim", "outbox"])
    ) == len(expected)


def test_check_worker_settings_warns_of_solo_deliveries_on_rabbitmq() -> None:
    outbox = Outbox(make_app({}, broker="amqp://guest:guest@127.0.0.1:1//"), lease=60)
    problems = outbox.check_worker_settings(pool="solo", concurrency=1, queues=["outbox"])
    assert any("solo pool on RabbitMQ" in p for p in problems), problems
    assert outbox.check_worker_settings(pool="solo", concurrency=1, queues=["outbox.claim"]) == []


def test_check_worker_settings_is_quiet_on_prefork() -> None:
    outbox = Outbox(make_app({}, broker="redis://127.0.0.1:1/0"), lease=60, pool_max_size=4)
    assert outbox.check_worker_settings(pool="prefork", concurrency=8) == []
    assert outbox.check_worker_settings(pool="celery.concurrency.prefork:TaskPool", concurrency=8) == []


# -- routing -------------------------------------------------------------------------------------


def test_tasks_route_to_the_outbox_queues_without_naming_one() -> None:
    app = make_app({"outbox_claim_queue": "cq", "outbox_default_queue": "dq"})
    Outbox(app)
    assert route_of(app, "outbox.claim") == "cq"
    assert route_of(app, "outbox.purge") == "cq"
    assert route_of(app, "outbox.deliver") == "dq"


def test_user_task_routes_still_apply() -> None:
    app = make_app({"task_routes": {"proj.*": {"queue": "proj"}, "outbox.purge": {"queue": "maint"}}})
    Outbox(app, claim_queue="cq")
    assert route_of(app, "proj.send") == "proj"
    assert route_of(app, "outbox.purge") == "maint"  # the user's route wins
    assert route_of(app, "outbox.claim") == "cq"


# -- unroutable messages -------------------------------------------------------------------------


def test_the_claim_only_takes_event_types_with_a_handler(
    migrated_dsn: str, conn: psycopg.Connection[Any]
) -> None:
    app = make_app({})
    outbox = Outbox(app, dsn=migrated_dsn, claim_interval=0.2)
    outbox.handler("known.type")(lambda m: None)
    with conn.transaction():
        orphan = enqueue(conn, event_type="unknown.type", payload={}, aggregate_type="t", aggregate_id=1)
    try:
        run = outbox.claim()
    finally:
        outbox.close()
    assert run.claimed == 0
    assert row(conn, "outbox", orphan)["status"] == "pending"
    assert row(conn, "outbox", orphan)["lease_version"] == 0


def test_a_worker_without_the_handler_postpones_with_the_attempt_refunded(
    migrated_dsn: str, conn: psycopg.Connection[Any]
) -> None:
    published: list[Any] = []
    claimer = Outbox(make_app({}), dsn=migrated_dsn, unroutable_delay=120)
    claimer.handler("order.created")(lambda m: None)
    worker = Outbox(make_app({}), dsn=migrated_dsn, unroutable_delay=120)  # a different deploy
    with conn.transaction():
        i = enqueue(conn, event_type="order.created", payload={}, aggregate_type="order", aggregate_id=1)
    try:
        run = claimer.claimer.run(lambda claims: published.extend(claims) or len(claims))
        assert run.claimed == 1
        outcome = worker.deliver(i, published[0].lease_version)
    finally:
        claimer.close()
        worker.close()
    assert outcome == "unroutable"
    r = row(conn, "outbox", i)
    assert r["status"] == "pending"
    assert r["attempts"] == 0
    assert 100 < r["available_in"] <= 120
    assert "no handler" in r["last_error"]


# -- a real worker refuses bad settings ----------------------------------------------------------


@pytest.mark.slow
def test_a_worker_with_bad_outbox_settings_refuses_to_start(
    migrated_dsn: str, redis_url: str, tmp_path: Any
) -> None:
    spec = AppSpec(
        dsn=migrated_dsn,
        broker_url=redis_url,
        outbox={"lease": 5, "claim_interval": 10, "claim_queue": "never.used"},
        routes={"thing.happened": None},
        via_celery_conf=True,
    )
    procs = CeleryProcesses(tmp_path, env=spec.env())
    try:
        worker = procs.worker(["never.used"], wait=False, pool="solo")
        worker.popen.wait(timeout=60)
        assert worker.popen.returncode != 0
        assert "ConfigurationError" in worker.log()
        assert "claim_interval must be shorter than lease" in worker.log()
    finally:
        procs.close()
