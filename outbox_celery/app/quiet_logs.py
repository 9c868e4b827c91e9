"""Celery's routine INFO lines about claim tasks, moved to DEBUG.

An :class:`~outbox_celery.app.outbox.Outbox` calls :func:`quiet_claim_logs` with its claim task's
name when it is created: beat sends that task every ``claim_interval`` and most runs find nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

__all__ = ["quiet_claim_logs"]


class _QuietClaims(logging.Filter):
    """Celery's per-task INFO lines about claim tasks, moved to DEBUG.

    Beat sends a claim every ``claim_interval`` and most runs find nothing: Celery's own
    ``Task outbox.claim[...] received`` / ``succeeded`` lines (and beat's ``Sending due task``)
    would fill an INFO log, while a run that did something logs its own INFO line (``outbox
    claim run: claimed=...``). A matching record is dropped unless its logger is enabled for
    DEBUG (``--loglevel DEBUG``), where it shows as a DEBUG record. Failures are untouched.
    """

    def __init__(self) -> None:
        super().__init__()
        self.tasks: set[str] = set()

    def _task(self, record: logging.LogRecord) -> str | None:
        args = record.args
        if isinstance(args, Mapping):  # celery.app.trace, celery.worker.strategy: a context dict
            name = args.get("name")
            return name if isinstance(name, str) else None
        if isinstance(args, tuple) and len(args) == 2 and isinstance(args[1], str):  # celery.beat
            return args[1]
        return None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or self._task(record) not in self.tasks:
            return True
        if not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return False
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return True


_quiet_claims = _QuietClaims()
# Where Celery logs a task's receipt and success, and beat each task it sends.
_TASK_LOGGERS = ("celery.app.trace", "celery.worker.strategy", "celery.beat")


def quiet_claim_logs(task_name: str) -> None:
    """Keep ``task_name``'s routine receipt/success/sent lines out of INFO logs (idempotent)."""
    _quiet_claims.tasks.add(task_name)
    for name in _TASK_LOGGERS:
        target = logging.getLogger(name)
        if _quiet_claims not in target.filters:
            target.addFilter(_quiet_claims)
