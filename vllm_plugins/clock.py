"""The one clock our draft-length and layer-plan decisions read.

Controllers and self-drafting proposers choose lengths and plans from
measured seconds. Under tensor parallel every rank runs them and must choose
the same, so a time they decide from cannot be a rank's own clock: the
bridge (``vllm_plugins.bridge.ranks``) then points ``now`` at a reader that
hands every rank the first rank's reading. On one rank ``now`` is
``time.perf_counter`` itself: no wrapper, no collective.

Call it as ``clock.now()`` (module attribute, looked up at each call) so the
bridge's choice reaches every caller; seconds that only feed metrics may
read ``time.perf_counter`` directly and stay rank-local.
"""

from __future__ import annotations

import time
from typing import Callable

now: Callable[[], float] = time.perf_counter


def use(read: Callable[[], float] | None) -> None:
    """Makes ``read`` the clock (None: this process's own perf_counter)."""
    global now
    now = read if read is not None else time.perf_counter
