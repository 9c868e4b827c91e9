"""Settings validation: TableName parsing and OutboxConfig, bad values raise ConfigurationError."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import pytest

from outbox_celery import ConfigurationError, OutboxConfig, TableName


@pytest.mark.parametrize(
    ("value", "schema", "name", "quoted"),
    [
        ("outbox", None, "outbox", '"outbox"'),
        ("events.outbox", "events", "outbox", '"events"."outbox"'),
        ("Out Box", None, "Out Box", '"Out Box"'),
        ("MyApp.Out Box", "MyApp", "Out Box", '"MyApp"."Out Box"'),
        ("select", None, "select", '"select"'),
        ("ümlaut.tåble", "ümlaut", "tåble", '"ümlaut"."tåble"'),
        ("x" * 40, None, "x" * 40, '"' + "x" * 40 + '"'),
    ],
)
def test_table_name_parses_plain_and_schema_qualified_names(
    value: str, schema: str | None, name: str, quoted: str
) -> None:
    table = TableName.parse(value)
    assert (table.schema, table.name) == (schema, name)
    assert table.qualified == value
    assert str(table) == value
    assert table.identifier().as_string() == quoted


def test_table_name_parse_returns_a_table_name_unchanged() -> None:
    table = TableName("outbox", "events")
    assert TableName.parse(table) is table


def test_sibling_and_index_names_are_quoted_and_never_schema_qualified() -> None:
    table = TableName.parse("events.Out Box")
    assert table.identifier("_x").as_string() == '"events"."Out Box_x"'
    assert table.index_name("_pending_idx").as_string() == '"Out Box_pending_idx"'


def test_identifiers_escape_nothing_into_sql_text() -> None:
    # A hostile-looking name stays one quoted identifier (DESIGN invariant 15).
    table = TableName.parse("x; DROP TABLE users; --")
    assert table.identifier().as_string() == '"x; DROP TABLE users; --"'


@pytest.mark.parametrize(
    "value",
    [
        "",
        ".",
        ".outbox",
        "events.",
        "a.b.c",
        'out"box',
        'events."outbox"',
        "out\x00box",
        "x" * 41,
        "s." + "x" * 41,
        "é" * 40,  # 40 characters but 80 bytes: past PostgreSQL's 63-byte identifier limit
        "ü" * 33,
    ],
)
def test_bad_table_names_raise_configuration_error(value: str) -> None:
    with pytest.raises(ConfigurationError, match="invalid table name"):
        TableName.parse(value)


@pytest.mark.parametrize("value", [None, 42, b"outbox", ["outbox"]])
def test_non_string_table_names_raise_configuration_error(value: Any) -> None:
    with pytest.raises(ConfigurationError, match="table must be a string"):
        TableName.parse(value)


def test_config_defaults() -> None:
    config = OutboxConfig()
    assert config.table == TableName("outbox")
    assert config.lease == 60.0
    assert config.batch_size == 200
    assert config.max_attempts == 12
    assert config.backoff_base == 1.0
    assert config.backoff_cap == 300.0
    assert config.max_defer_age == 7 * 24 * 3600.0
    assert config.max_payload_bytes == 1024 * 1024
    assert config.effective_claim_budget == 1.0
    assert config.effective_min_in_flight == 200
    assert config.task_time_limit < config.lease


def test_config_accepts_timedelta_and_table_strings() -> None:
    config = OutboxConfig(
        table="events.outbox",
        lease=timedelta(minutes=2),
        claim_interval=timedelta(milliseconds=250),
        max_defer_age=timedelta(days=1),
    )
    assert config.table == TableName("outbox", "events")
    assert config.lease == 120.0
    assert config.claim_interval == 0.25
    assert config.max_defer_age == 86400.0
    assert isinstance(config.lease, float)


def test_config_optional_seconds_may_be_none() -> None:
    config = OutboxConfig(retention=None, claim_budget=None)
    assert config.retention is None
    assert config.effective_claim_budget == 1.0


def test_done_batch_delay_zero_writes_each_done_and_timedelta_is_seconds() -> None:
    assert OutboxConfig().done_batch_delay == 0.05
    assert OutboxConfig(done_batch_delay=0).done_batch_delay == 0.0
    assert OutboxConfig(done_batch_delay=timedelta(milliseconds=200)).done_batch_delay == 0.2


def test_config_is_frozen() -> None:
    config = OutboxConfig()
    with pytest.raises(AttributeError):
        config.lease = 5.0  # type: ignore[misc]


@pytest.mark.parametrize(
    "changes",
    [
        {"table": "a.b.c"},
        {"table": 5},
        {"lease": 0},
        {"lease": -1},
        {"lease": math.nan},
        {"lease": math.inf},
        {"lease": "60"},
        {"lease": True},
        {"lease": None},
        {"claim_interval": 0},
        {"backoff_base": -0.5},
        {"max_defer_age": timedelta(seconds=-1)},
        {"retention": 0},
        {"batch_size": 0},
        {"batch_size": 1.5},
        {"batch_size": True},
        {"batch_size": "10"},
        {"max_attempts": 0},
        {"max_attempts": -3},
        {"max_in_flight": 0},
        {"min_in_flight": 0},
        {"max_payload_bytes": 0},
        {"pool_max_size": 0},
        {"pool_max_size": 1},
        {"prepare_threshold": -1},
        {"prepare_threshold": True},
        {"prepare_threshold": "5"},
        {"retention_batch_size": 0},
        {"backoff_base": 10.0, "backoff_cap": 5.0},
        {"claim_interval": 60.0, "lease": 60.0},
        {"claim_interval": 2.0, "lease": 1.0},
        {"dsn": 123},
        {"claim_queue": ""},
        {"default_queue": None},
        {"done_batch_delay": -0.1},
        {"done_batch_delay": True},
        {"done_batch_delay": 15.0},  # lease / 4 with the default lease of 60
        {"done_batch_delay": 0.6, "lease": 2.0, "claim_interval": 1.0},
    ],
)
def test_bad_settings_raise_configuration_error(changes: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        OutboxConfig(**changes)


def test_replace_validates_the_copy() -> None:
    config = OutboxConfig(lease=30)
    assert config.replace(lease=45).lease == 45.0
    assert config.lease == 30.0
    with pytest.raises(ConfigurationError):
        config.replace(max_attempts=0)


def test_from_mapping_reads_outbox_keys_and_overrides_win() -> None:
    conf = {"outbox_lease": 30, "outbox_table": "events.outbox", "outbox_batch_size": None, "other": 1}
    config = OutboxConfig.from_mapping(conf, max_attempts=5, lease=40)
    assert config.lease == 40.0
    assert config.table == TableName("outbox", "events")
    assert config.batch_size == 200
    assert config.max_attempts == 5


def test_from_mapping_refuses_unknown_overrides() -> None:
    with pytest.raises(ConfigurationError, match="unknown outbox setting"):
        OutboxConfig.from_mapping({}, leese=30)


def test_from_mapping_validates_values_from_the_celery_config() -> None:
    with pytest.raises(ConfigurationError):
        OutboxConfig.from_mapping({"outbox_lease": -5})


def test_min_in_flight_is_capped_by_max_in_flight() -> None:
    assert OutboxConfig(batch_size=500, max_in_flight=100).effective_min_in_flight == 100
    assert OutboxConfig(min_in_flight=10).effective_min_in_flight == 10


@pytest.mark.parametrize("lease", [0.5, 1.0, 1.1, 1.99])
def test_leases_too_short_for_a_time_limit_below_them_are_refused(lease: float) -> None:
    """The hard time limit was max(1, 0.9 * lease): not below leases under ~1.1 s."""
    with pytest.raises(ConfigurationError, match="lease must be at least 2 s"):
        OutboxConfig(lease=lease, claim_interval=0.1)


@pytest.mark.parametrize("lease", [2.0, 2.5, 4.0, 10.0, 60.0, 3600.0])
def test_delivery_time_limits_are_always_below_the_lease(lease: float) -> None:
    config = OutboxConfig(lease=lease, claim_interval=0.1)
    hard = config.task_time_limit
    soft = max(hard * 0.9, hard - 1.0)
    assert 0 < soft < hard < lease


def test_prepare_threshold_none_disables_prepared_statements_also_from_celery_conf() -> None:
    assert OutboxConfig().prepare_threshold == 5
    assert OutboxConfig(prepare_threshold=None).prepare_threshold is None
    conf = {"outbox_prepare_threshold": None}
    assert OutboxConfig.from_mapping(conf).prepare_threshold is None
    assert OutboxConfig.from_mapping({"outbox_prepare_threshold": 0}).prepare_threshold == 0


def test_with_the_lease_heartbeat_the_time_limit_is_the_handler_time_limit() -> None:
    assert OutboxConfig(lease=30).task_time_limit == 27.0
    assert OutboxConfig(lease=30, lease_heartbeat=True).task_time_limit == 300.0
    config = OutboxConfig(lease=30, lease_heartbeat=True, handler_time_limit=timedelta(hours=1))
    assert config.task_time_limit == 3600.0


@pytest.mark.parametrize(
    "changes",
    [
        {"handler_time_limit": 100.0},
        {"lease_heartbeat": "yes"},
        {"lease_heartbeat": True, "handler_time_limit": 0},
    ],
)
def test_bad_heartbeat_settings_raise_configuration_error(changes: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        OutboxConfig(**changes)


def test_outbox_keywords_win_over_celery_settings_and_unknown_names_still_raise() -> None:
    from celery import Celery

    from outbox_celery import Outbox

    app = Celery("keywords", set_as_current=False)
    app.conf.outbox_batch_size = 7
    app.conf.outbox_lease = 30
    outbox = Outbox(app, lease=40, retention=None)
    assert (outbox.config.batch_size, outbox.config.lease, outbox.config.retention) == (7, 40.0, None)
    with pytest.raises(ConfigurationError, match="unknown outbox setting"):
        Outbox(app, leese=30)


def test_transactional_handler_options_are_checked_at_registration() -> None:
    from celery import Celery

    from outbox_celery import Outbox
    from outbox_celery.transactional import DjangoTransaction, PsycopgTransaction, SqlAlchemyTransaction

    outbox = Outbox(Celery("tx", set_as_current=False), retention=None)
    outbox.handler("a", transactional=True)(lambda m, conn: None)
    outbox.handler("b", transactional="sqlalchemy", session_factory=lambda: None)(lambda m, s: None)
    outbox.handler("c", transactional="django", using="other")(lambda m, c: None)
    outbox.handler("d")(lambda m: None)
    kinds = {k: s.transaction for k, s in outbox.handlers.items()}
    assert isinstance(kinds["a"], PsycopgTransaction)
    assert isinstance(kinds["b"], SqlAlchemyTransaction)
    assert isinstance(kinds["c"], DjangoTransaction) and kinds["c"].using == "other"
    assert kinds["d"] is None
    for bad, match in (
        ({"transactional": "mongo"}, "transactional must be"),
        ({"transactional": "sqlalchemy"}, "needs session_factory"),
        ({"transactional": True, "session_factory": lambda: None}, "goes with transactional='sqlalchemy'"),
        ({"using": "other"}, "goes with transactional='django'"),
    ):
        with pytest.raises(ConfigurationError, match=match):
            outbox.handler("e", **bad)
