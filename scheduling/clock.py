"""The scheduler's clock: every time the scheduling code reads goes through `now()`.

It is `time.monotonic` in the Coordinator. bench/scheduling.py replays whole workloads in virtual time by
pointing it at its event loop's clock (`use`), so the same scheduling code runs there as in the gateway.
"""

from __future__ import annotations

import time
from collections.abc import Callable

now: Callable[[], float] = time.monotonic


def use(clock: Callable[[], float]) -> None:
    """Read time from `clock` from now on (a benchmark's virtual time)."""
    global now
    now = clock
