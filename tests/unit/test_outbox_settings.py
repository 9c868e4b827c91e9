"""One declaration per setting: ``Outbox`` takes the fields of ``OutboxConfig`` and nothing else.

The keywords of ``Outbox(...)`` are checked against ``OutboxConfig``'s fields (an unknown name
names the closest ones), ``config=`` takes a whole ``OutboxConfig``, passing ``UNSET`` is
deprecated, and docs/celery.md's settings table and the class docstring describe every field.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from outbox_celery import ConfigurationError, Outbox, OutboxConfig
from outbox_celery.config import UNSET

DOCS = Path(__file__).resolve().parents[2] / "docs" / "celery.md"
FIELDS = [f.name for f in dataclasses.fields(OutboxConfig)]


def _app(**conf: Any) -> Celery:
    app = Celery("settings", set_as_current=False)
    app.conf.update(conf)
    return app


def test_outbox_declares_no_setting_of_its_own() -> None:
    params = inspect.signature(Outbox).parameters
    assert set(params) == {"app", "name", "config", "store", "retry", "settings"}
    assert params["settings"].kind is inspect.Parameter.VAR_KEYWORD


@pytest.mark.parametrize("name", FIELDS)
def test_every_config_field_is_an_outbox_keyword(name: str) -> None:
    value = getattr(OutboxConfig(), name)
    outbox = Outbox(_app(), **{name: value})
    assert getattr(outbox.config, name) == value
    assert name in outbox._settings


def test_keywords_win_over_celery_settings_which_win_over_defaults() -> None:
    outbox = Outbox(_app(outbox_batch_size=7, outbox_lease=30), lease=40, retention=None)
    assert (outbox.config.batch_size, outbox.config.lease, outbox.config.max_attempts) == (7, 40.0, 12)


def test_a_whole_config_is_taken_and_keywords_override_it() -> None:
    base = OutboxConfig(lease=30, batch_size=7, retention=None)
    outbox = Outbox(_app(), config=base, lease=40)
    assert outbox.config == base.replace(lease=40)
    assert Outbox(_app(), config=base).config == base


def test_a_whole_config_refuses_outbox_settings_in_the_celery_configuration() -> None:
    outbox = Outbox(_app(outbox_lease=45, outbox_batch_size=3), config=OutboxConfig(retention=None))
    with pytest.raises(ConfigurationError, match="outbox_batch_size, outbox_lease") as raised:
        outbox.config  # noqa: B018 - resolving is what raises
    assert "OutboxConfig" in str(raised.value)


def test_config_must_be_an_outbox_config() -> None:
    with pytest.raises(ConfigurationError, match="config must be an OutboxConfig, got dict"):
        Outbox(_app(), config={"lease": 30})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("typo", "suggested"),
    [
        ("leese", "'lease'"),
        ("max_attempt", "'max_attempts'"),
        ("batchsize", "'batch_size'"),
        ("listen_dns", "'listen_dsn'"),
    ],
)
def test_an_unknown_setting_fails_naming_the_close_matches(typo: str, suggested: str) -> None:
    with pytest.raises(ConfigurationError, match="unknown outbox setting") as raised:
        Outbox(_app(), **{typo: 30})
    assert f"{typo!r} (did you mean {suggested}" in str(raised.value)
    with pytest.raises(ConfigurationError, match=re.escape(f"did you mean {suggested}")):
        OutboxConfig.from_mapping({}, **{typo: 30})


def test_an_unknown_setting_with_nothing_close_still_fails_clearly() -> None:
    with pytest.raises(ConfigurationError) as raised:
        Outbox(_app(), zzz=1)
    assert str(raised.value) == (
        "unknown outbox setting(s): 'zzz'; the settings are the fields of OutboxConfig"
    )


def test_passing_unset_warns_what_to_write_instead_and_still_works() -> None:
    """The deprecated spelling: ``Outbox(app, lease=UNSET)`` is ``Outbox(app)``."""
    with pytest.warns(DeprecationWarning, match=r"leave out batch_size=, lease= instead") as caught:
        outbox = Outbox(_app(outbox_lease=30), lease=UNSET, batch_size=UNSET, retention=None)
    assert caught[0].filename == __file__  # attributed to the caller, where the fix goes
    assert (outbox.config.lease, outbox.config.batch_size, outbox.config.retention) == (30.0, 200, None)
    assert "lease" not in outbox._settings


def test_the_current_style_does_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Outbox(_app(), dsn="postgresql://app@db/app", lease=30, retention=None).config  # noqa: B018
        Outbox(_app(), config=OutboxConfig(lease=30), batch_size=10).config  # noqa: B018


def _settings_table() -> list[tuple[str, str]]:
    """``(name, default)`` of each row of docs/celery.md's settings table, in order."""
    text = DOCS.read_text(encoding="utf-8")
    section = text[text.index("## Settings") :]
    header = section.index("| setting | default | meaning |")
    rows = []
    for line in section[header:].splitlines()[2:]:
        if not line.startswith("|"):
            break  # the table ends at its first non-row line: a blank line would cut it here
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append((cells[0].strip("`"), cells[1]))
    return rows


def test_the_settings_table_has_one_row_per_config_field() -> None:
    names = [name for name, _ in _settings_table()]
    assert sorted(names) == sorted(FIELDS), "docs/celery.md's settings table and OutboxConfig differ"
    assert len(names) == len(set(names))


def _documented(default: Any) -> list[str]:
    """How a default may be written in the table's default column."""
    if isinstance(default, bool | str):
        return [f"`{default!r}`".replace("'", '"')]
    if default == 7 * 24 * 3600:
        return ["7 days"]
    if default == 1024 * 1024:
        return ["1 MiB"]
    return [f"`{default:g}`", f"`{default:.1f}`"]


@pytest.mark.parametrize(("name", "cell"), _settings_table())
def test_the_settings_table_shows_each_default(name: str, cell: str) -> None:
    default = OutboxConfig.__dataclass_fields__[name].default
    if default is None or default is dataclasses.MISSING:
        return  # computed or read elsewhere: the cell says from what (`10 * lease`, OUTBOX_DSN)
    assert any(cell.startswith(form) for form in _documented(default)), (name, cell, default)


@pytest.mark.parametrize("name", FIELDS)
def test_every_config_field_is_described_in_the_class_docstring(name: str) -> None:
    doc = OutboxConfig.__doc__ or ""
    match = re.search(rf":ivar {name}: (.+?)(?=\n    :ivar |\Z)", doc, re.S)
    assert match, f"OutboxConfig's docstring has no ':ivar {name}:'"
    assert len(match.group(1).split()) >= 5, f"':ivar {name}:' says too little"
