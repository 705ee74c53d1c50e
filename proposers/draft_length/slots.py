"""Per-request state of the draft-length controllers, in rows of numpy arrays.

Controllers learn per request, and batches hold up to hundreds of requests:
one row per live request in preallocated arrays keeps every per-step update
a vectorised gather/scatter instead of a Python loop over dicts.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class RequestSlots:
    """Maps request ids to rows of per-request numpy arrays.

    Rows are reused: a finished request's row is reset and put on a free list.
    Capacity doubles when full, so memory follows the peak number of live
    requests. ``max_tracked`` bounds it even if finish notices are lost: the
    least recently seen request is evicted (set it above max_num_seqs).
    """

    def __init__(self, max_tracked: int = 65536, initial: int = 32):
        self.max_tracked = max_tracked
        self.capacity = max(1, min(initial, max_tracked))
        self._ids: dict[str, int] = {}
        self._owner: dict[int, str] = {}
        self._free = list(range(self.capacity - 1, -1, -1))
        self._specs: dict[str, tuple[tuple, Any, Any]] = {}
        self.arrays: dict[str, np.ndarray] = {}
        self.evicted = 0
        self._tick = 0
        self.add("_seen", (), np.int64, -1)   # last tick a row was looked up

    def add(self, name: str, tail: tuple, dtype: Any, fill: Any) -> None:
        self._specs[name] = (tail, dtype, fill)
        self.arrays[name] = np.full((self.capacity, *tail), fill, dtype=dtype)

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._ids

    def get(self, req_id: str) -> int | None:
        return self._ids.get(req_id)

    def slots(self, req_ids: list[str]) -> np.ndarray:
        """Rows for these requests (created on first sight), marked as seen."""
        self._tick += 1
        get = self._ids.get
        out = [get(rid) for rid in req_ids]
        if None in out:
            found = [o for o in out if o is not None]
            self.arrays["_seen"][found] = self._tick   # protected from eviction
            for i, rid in enumerate(req_ids):
                if out[i] is None:
                    out[i] = self._allocate(rid)
        rows = np.array(out, dtype=np.int64)
        seen = self.arrays["_seen"]
        if len(out) <= 16:   # a few rows: cheaper one by one than by fancy index
            for row in out:
                seen[row] = self._tick
        else:
            seen[rows] = self._tick
        return rows

    def release(self, req_id: str) -> None:
        slot = self._ids.pop(req_id, None)
        if slot is not None:
            del self._owner[slot]
            self._reset(slot)
            self._free.append(slot)

    def _allocate(self, req_id: str) -> int:
        while len(self._ids) >= self.max_tracked:
            # Lost finish notices: evict the least recently seen request (one
            # of the current lookup only if the batch alone exceeds the cap).
            seen = self.arrays["_seen"]
            live = np.fromiter(self._owner, dtype=np.int64, count=len(self._owner))
            victim = int(live[np.argmin(seen[live])])
            self.release(self._owner[victim])
            self.evicted += 1
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self._reset(slot)
        self._ids[req_id] = slot
        self._owner[slot] = req_id
        self.arrays["_seen"][slot] = self._tick
        return slot

    def _grow(self) -> None:
        old = self.capacity
        new = min(max(2 * old, 1), max(self.max_tracked, old + 1))
        for name, (tail, dtype, fill) in self._specs.items():
            arr = np.full((new, *tail), fill, dtype=dtype)
            arr[:old] = self.arrays[name]
            self.arrays[name] = arr
        self._free.extend(range(new - 1, old - 1, -1))
        self.capacity = new

    def _reset(self, slot: int) -> None:
        for name, (_, _, fill) in self._specs.items():
            self.arrays[name][slot] = fill

    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.arrays.values()))

