"""The import paths of modules that moved into the package's folders, still importable.

``import outbox_celery.store`` gives the module now at ``outbox_celery.db.store`` (the same module
object) and warns once with a :class:`DeprecationWarning` naming the new path. One table, one
finder on :data:`sys.meta_path`, installed by the package's ``__init__``; no file is left at an
old path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

__all__ = ["MOVED", "install"]

#: Old module path -> where it lives now.
MOVED = {
    "outbox_celery._sql": "outbox_celery.db.statements",
    "outbox_celery.complete": "outbox_celery.db.completer",
    "outbox_celery.store": "outbox_celery.db.store",
    "outbox_celery.migrations": "outbox_celery.db.migrations",
    "outbox_celery._pool": "outbox_celery.db.pool",
    "outbox_celery.producer": "outbox_celery.produce.enqueue",
    "outbox_celery.writes": "outbox_celery.produce.writes",
    "outbox_celery._connections": "outbox_celery.produce.connections",
    "outbox_celery.claim_plan": "outbox_celery.claim.plan",
    "outbox_celery.listener": "outbox_celery.claim.listener",
    "outbox_celery.dispatch": "outbox_celery.worker.deliverer",
    "outbox_celery.batch": "outbox_celery.worker.batch",
    "outbox_celery.slot_wake": "outbox_celery.worker.slot_wake",
    "outbox_celery.verdict": "outbox_celery.worker.verdict",
    "outbox_celery._done_batch": "outbox_celery.worker.done_batch",
    "outbox_celery.heartbeat": "outbox_celery.worker.heartbeat",
    "outbox_celery.celery_app": "outbox_celery.app.outbox",
    "outbox_celery.tasks": "outbox_celery.app.tasks",
    "outbox_celery.publisher": "outbox_celery.app.publisher",
    "outbox_celery.celery_config": "outbox_celery.app.celery_config",
    "outbox_celery.worker_settings": "outbox_celery.app.worker_settings",
    "outbox_celery.worker_signals": "outbox_celery.app.signals",
    "outbox_celery.push": "outbox_celery.app.push",
    "outbox_celery.operations": "outbox_celery.ops",
    "outbox_celery.admin": "outbox_celery.ops",
    "outbox_celery.groups": "outbox_celery.ops.groups",
    "outbox_celery.subscriptions": "outbox_celery.ops.subscriptions",
    "outbox_celery.console": "outbox_celery.ops.console",
    "outbox_celery.health": "outbox_celery.ops.health",
    "outbox_celery.discovery": "outbox_celery.cli.discovery",
    "outbox_celery.web.serve": "outbox_celery.cli.web",
}


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module at its new one."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.new}; import it from there",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module at the new path has run already."""


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Put the finder on :data:`sys.meta_path` (once)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
