"""Finding the Outbox the CLI operates: ``--app module:attr``, or the app ``celery -A`` loaded.

An Outbox is told from anything else a module holds by its class: every
:class:`~outbox_celery.app.outbox.Outbox` is an :class:`~outbox_celery.operated.OperatedOutbox`,
which the CLI knows without importing the Celery side (:mod:`outbox_celery.app`).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import click

from ..errors import first_line
from ..operated import OperatedOutbox

__all__ = ["celery_outbox_finder", "load_object", "outboxes_in", "resolve_outbox"]


def load_object(spec: str) -> Any:
    """Import ``module[:attr.path]``; the current directory is importable, as with ``celery -A``."""
    module_name, _, attr = spec.partition(":")
    if not module_name:
        raise click.ClickException(f"invalid --app {spec!r}: use module.path:attribute")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise click.ClickException(
            f"cannot import {module_name!r}: {type(exc).__name__}: {first_line(exc)}"
        ) from None
    for part in filter(None, attr.split(".")):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise click.ClickException(f"{module_name!r} has no attribute {attr!r}") from None
    return obj


def outboxes_in(modules: Sequence[ModuleType], app: Any = None) -> list[OperatedOutbox]:
    """The distinct Outbox objects held by ``modules`` (bound to ``app`` when given)."""
    found: dict[int, OperatedOutbox] = {}
    for module in modules:
        for value in list(vars(module).values()):
            if isinstance(value, OperatedOutbox) and (app is None or value.app is app):
                found[id(value)] = value
    return list(found.values())


def resolve_outbox(spec: str) -> OperatedOutbox:
    """The Outbox named by ``spec``: an Outbox, a Celery app or a module holding exactly one."""
    from celery import Celery

    obj = load_object(spec)
    if isinstance(obj, OperatedOutbox):
        return obj
    if isinstance(obj, ModuleType):
        candidates = outboxes_in([obj])
    elif isinstance(obj, Celery):
        candidates = outboxes_in(list(sys.modules.values()), app=obj)
    else:
        raise click.ClickException(f"{spec!r} is a {type(obj).__name__}, not an Outbox")
    if len(candidates) != 1:
        what = "no Outbox" if not candidates else f"{len(candidates)} Outbox objects"
        raise click.ClickException(f"{spec!r} holds {what}; name one as module:attribute")
    return candidates[0]


def celery_outbox_finder(ctx: click.Context, name: str | None) -> Callable[[], OperatedOutbox | None]:
    """Find the Outbox of the app ``celery -A`` loaded (optionally by its name)."""

    def find() -> OperatedOutbox | None:
        celery_ctx = ctx.find_root().obj
        app = getattr(celery_ctx, "app", None)
        if app is None:
            return None
        found = outboxes_in(list(sys.modules.values()), app=app)
        if not found:
            # The Outbox may live in a module the app only imports lazily (``include``,
            # ``autodiscover_tasks``): import them as a worker would, then look again.
            try:
                app.loader.import_default_modules()
            except Exception as exc:
                raise click.ClickException(
                    f"cannot import the app's task modules: {type(exc).__name__}: {first_line(exc)}"
                ) from None
            found = outboxes_in(list(sys.modules.values()), app=app)
        if name is not None:
            found = [o for o in found if o.name == name]
            if not found:
                raise click.ClickException(f"no Outbox named {name!r} bound to app {app.main!r}")
        if len(found) > 1:
            names = ", ".join(sorted(o.name for o in found))
            raise click.ClickException(
                f"app {app.main!r} has several outboxes ({names}); pick one with --outbox"
            )
        return found[0] if found else None

    return find
