"""Push settings: defaults and validation."""

from __future__ import annotations

import pytest

from outbox_celery import ConfigurationError, OutboxConfig


def test_push_defaults_make_beat_a_safety_net() -> None:
    config = OutboxConfig()
    assert config.listen is True
    assert config.listen_dsn is None
    assert config.listen_poll == 1.0
    assert config.claim_interval == 5.0
    assert config.effective_claim_budget == 1.0


@pytest.mark.parametrize("bad", [{"listen_poll": 0}, {"listen_poll": -1}, {"listen_dsn": 5}])
def test_push_settings_are_validated(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        OutboxConfig(**bad)  # type: ignore[arg-type]


def test_push_settings_come_from_celery_conf() -> None:
    config = OutboxConfig.from_mapping(
        {"outbox_listen": False, "outbox_listen_dsn": "postgresql://x@h/db", "outbox_listen_poll": 0.25}
    )
    assert (config.listen, config.listen_dsn, config.listen_poll) == (False, "postgresql://x@h/db", 0.25)
