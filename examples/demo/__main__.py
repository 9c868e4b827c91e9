"""``python -m examples.demo``: see :mod:`examples.demo.engine`."""

from __future__ import annotations

import sys

from .engine import main

sys.exit(main())
