"""Warnings logged once per distinct message, in bounded memory.

A processor warns once per distinct problem, but some problems carry the
request's own text (a grammar that fails in the worker, a matcher's error):
remembering every one of them for the engine's life grows without bound on
a server that sees many distinct bad requests. ``LogOnce`` remembers the
most recent ``size`` keys (by hash, so a long message costs no more than a
short one); a key forgotten since is logged again, which costs one more log
line, never memory.
"""

from __future__ import annotations

from collections import OrderedDict

#: Distinct keys a processor remembers (about 100 bytes each).
LOG_ONCE_KEYS = 256


class LogOnce:
    def __init__(self, size: int = LOG_ONCE_KEYS):
        self.size = size
        self._seen: OrderedDict[int, None] = OrderedDict()

    def first(self, key: str) -> bool:
        """Whether ``key`` is new (among the last ``size``): log it then."""
        h = hash(key)
        if h in self._seen:
            self._seen.move_to_end(h)
            return False
        self._seen[h] = None
        if len(self._seen) > self.size:
            self._seen.popitem(last=False)
        return True

    def __len__(self) -> int:
        return len(self._seen)
