"""Run a process with a shifted clock: Debian's ``libfaketime`` preloaded through the environment.

``faketime_env("+5s")`` returns the variables that make every process started with them (and
their forked children, such as a prefork pool) see the wall clock five seconds ahead, while
PostgreSQL, the broker and the test process keep the real time. Monotonic clocks move at the
same rate, only shifted, so sleeps and timeouts behave normally.
"""

from __future__ import annotations

import glob
import os

import pytest

# Where Debian and Ubuntu install the library (``apt-get install faketime``); FAKETIME_LIB wins.
_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/*/faketime/libfaketimeMT.so.1",
    "/usr/local/lib/faketime/libfaketimeMT.so.1",
)


def library() -> str | None:
    """Path of libfaketime's multi-threaded variant, or ``None`` where it is not installed."""
    configured = os.environ.get("FAKETIME_LIB")
    if configured:
        return configured if os.path.exists(configured) else None
    for pattern in _CANDIDATES:
        for path in sorted(glob.glob(pattern)):
            if os.path.exists(path):
                return path
    return None


def faketime_env(offset: str) -> dict[str, str]:
    """Environment that shifts a process's clock by ``offset`` (``"+5s"``, ``"-5s"``); skips
    the calling test with the reason when libfaketime is missing."""
    lib = library()
    if lib is None:
        pytest.skip("libfaketime not installed (Debian: apt-get install faketime); clock skew needs it")
    return {
        "LD_PRELOAD": lib,
        "FAKETIME": offset,
        # Re-read nothing from files, never cache: the offset is fixed for the process's life.
        "FAKETIME_NO_CACHE": "1",
        # Not FAKETIME_DONT_FAKE_MONOTONIC: with it, libfaketime makes time.sleep() (and so the
        # push listener's waits) fail with EINVAL. A fixed offset on the monotonic clock changes
        # no duration, which is all that clock is used for.
    }


def clock_offset(env: dict[str, str]) -> float:
    """Seconds a Python process started with ``env`` sees its wall clock off from ours."""
    import subprocess
    import sys
    import time

    before = time.time()
    out = subprocess.run(
        [sys.executable, "-c", "import time; print(time.time())"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return float(out) - before
