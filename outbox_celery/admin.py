"""Deprecated name of :mod:`outbox_celery.operations`, the operator reads and actions.

Renamed so that it is not mistaken for the Django admin (``outbox_celery.contrib.django.admin``).
Importing this module warns and gives the same module object; it goes in a later release.
"""

from __future__ import annotations

import sys
import warnings

from . import operations

warnings.warn(
    "outbox_celery.admin is now outbox_celery.operations; import that instead",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = operations
