"""Handler outcomes: RetryableError (optional delay), PermanentError, Defer (delay, reason)."""

from __future__ import annotations

import ast
import builtins
import importlib
import math
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import outbox_celery
from outbox_celery import (
    ConfigurationError,
    Defer,
    OutboxError,
    PermanentError,
    ProducerError,
    RetryableError,
    errors,
    inbox,
    ops,
)
from outbox_celery.db import migrations
from outbox_celery.errors import MAX_DELAY_SECONDS, AdminError, InboxError, MigrationError, first_line

PACKAGE = Path(outbox_celery.__file__).parent


def test_every_exception_shares_one_root() -> None:
    for exc in (
        ConfigurationError,
        ProducerError,
        RetryableError,
        PermanentError,
        Defer,
        AdminError,
        InboxError,
        MigrationError,
    ):
        assert issubclass(exc, OutboxError)


def test_every_public_exception_class_in_the_package_is_under_the_root() -> None:
    # Read from the source, so a module that cannot be imported here (Django's) is checked too.
    # Outside errors.py a public exception derives from the root's family only; a private
    # control-flow exception (a leading underscore) is no error a caller sees.
    builtin = {name for name in dir(builtins) if isinstance(getattr(builtins, name), type)}
    family = {name for name in errors.__all__ if isinstance(getattr(errors, name), type)}
    strays = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
                continue
            bases = {ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases}
            if (node.name.endswith("Error") or bases & builtin) and not bases <= family:
                strays.append(f"{path.relative_to(PACKAGE)}: {node.name}({', '.join(sorted(bases))})")
    assert strays == []


def test_the_moved_errors_keep_their_import_paths() -> None:
    assert ops.AdminError is AdminError
    assert inbox.InboxError is InboxError
    assert migrations.MigrationError is MigrationError


def test_bad_input_errors_are_value_errors() -> None:
    assert issubclass(ConfigurationError, ValueError)
    assert issubclass(ProducerError, ValueError)
    assert issubclass(AdminError, ValueError)


@pytest.mark.parametrize(
    ("exc", "line"),
    [
        (ValueError("bad value\nDETAIL: more\nHINT: even more"), "bad value"),
        (ValueError("  padded  \n"), "padded"),
        (ValueError(""), "ValueError"),
        (KeyError(), "KeyError"),
        (OSError("   \n  "), "OSError"),
    ],
)
def test_first_line_is_the_first_line_or_the_type_name(exc: BaseException, line: str) -> None:
    assert first_line(exc) == line


def test_retryable_error_without_delay_leaves_backoff_to_the_policy() -> None:
    exc = RetryableError("HTTP 503")
    assert exc.delay is None
    assert str(exc) == "HTTP 503"


def test_retryable_error_has_a_default_message() -> None:
    assert str(RetryableError()) == "retryable error"


@pytest.mark.parametrize(
    ("delay", "seconds"),
    [(0, 0.0), (30, 30.0), (2.5, 2.5), (timedelta(minutes=2), 120.0), (timedelta(0), 0.0)],
)
def test_retryable_error_carries_a_retry_after_delay(delay: float | timedelta, seconds: float) -> None:
    exc = RetryableError("HTTP 429", delay=delay)
    assert exc.delay == seconds
    assert isinstance(exc.delay, float)


@pytest.mark.parametrize("delay", [-1, -0.001, timedelta(seconds=-5), math.nan, math.inf])
def test_retryable_error_refuses_a_negative_or_non_finite_delay(delay: float | timedelta) -> None:
    with pytest.raises(ValueError, match="delay"):
        RetryableError("x", delay=delay)


def test_retryable_error_delay_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        RetryableError("x", 5)  # type: ignore[misc]


def test_permanent_error_keeps_its_message() -> None:
    assert str(PermanentError("HTTP 400: bad address")) == "HTTP 400: bad address"


@pytest.mark.parametrize(("delay", "seconds"), [(60, 60.0), (0.5, 0.5), (timedelta(hours=1), 3600.0)])
def test_defer_carries_delay_and_reason(delay: float | timedelta, seconds: float) -> None:
    exc = Defer(delay, "payment not captured yet")
    assert exc.delay == seconds
    assert exc.reason == "payment not captured yet"
    assert str(exc) == "payment not captured yet"


def test_defer_has_a_default_reason() -> None:
    assert Defer(1).reason == "deferred"


@pytest.mark.parametrize("delay", [-1, timedelta(seconds=-1), math.nan, math.inf, -math.inf])
def test_defer_refuses_a_negative_or_non_finite_delay(delay: float | timedelta) -> None:
    with pytest.raises(ValueError, match="delay"):
        Defer(delay)


def test_defer_requires_a_delay() -> None:
    with pytest.raises(TypeError):
        Defer()  # type: ignore[call-arg]


@pytest.mark.parametrize("cls", [lambda d: RetryableError("x", delay=d), lambda d: Defer(d)])
def test_absurd_delays_are_refused_before_postgresql_overflows(cls: Any) -> None:
    # make_interval(secs => 1e15) silently wraps negative on PostgreSQL 15: a row would be due now.
    with pytest.raises(ValueError, match="100 years"):
        cls(1e15)
    cls(MAX_DELAY_SECONDS)


@pytest.mark.parametrize("cls", [lambda d: RetryableError("x", delay=d), lambda d: Defer(d)])
def test_a_boolean_is_not_a_delay(cls: Any) -> None:
    # True is an int to Python, not a number of seconds: refused like every other setting.
    with pytest.raises(ValueError, match="delay must be a number of seconds"):
        cls(True)


def test_the_old_name_of_the_operator_module_warns_and_is_the_same_module() -> None:
    sys.modules.pop("outbox_celery.admin", None)
    with pytest.warns(DeprecationWarning, match="outbox_celery.ops"):
        old = importlib.import_module("outbox_celery.admin")
    assert old is ops
