"""What our state in a worker holds right now, counted (a debug hook).

A server's RSS moves with the allocator, vLLM's own caches and batch shapes,
so it cannot show a leak of one small object per request without flaking.
These counts can: they cover only what this package keeps, and on an idle
engine (no request running, none whose finish notice is still held) they
are the same after every round of the same requests, so any growth is ours.

* ``request_keyed``: string keys of dicts and string members of (mutable)
  sets in our runner state and our proposer (walked through our own objects
  and plain containers), leaving out live requests' ids and the finish
  notices held for the next proposal. Per-request state lives under request
  ids: a request whose state is never freed adds entries here. Frozensets
  are snapshots (the batch a rest began with), replaced and never grown.
* ``objects``: instances of this package's classes the garbage collector
  tracks anywhere in the process, since vLLM froze its start-up heap
  (``gc.freeze``): a per-request object kept anywhere, by us or by vLLM,
  adds one.
* ``containers``: entries of every container the walk met (bounded caches
  that fill with batch shapes move it: reported, not a leak by itself).
"""

from __future__ import annotations

import gc

_OURS = "vllm_plugins"


def _is_ours(obj) -> bool:
    module = getattr(type(obj), "__module__", None)
    return isinstance(module, str) and module.startswith(_OURS)


def walk_counts(roots, skip_keys=frozenset(), skip_ids=frozenset()) -> tuple[int, int]:
    """(request-keyed entries, container entries) reachable from ``roots``
    through our objects' attributes and plain containers."""
    keyed = entries = 0
    seen: set[int] = set(skip_ids)
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            entries += len(obj)
            for k, v in obj.items():
                if isinstance(k, str) and k not in skip_keys:
                    keyed += 1
                stack.append(v)
        elif isinstance(obj, set):
            entries += len(obj)
            keyed += sum(1 for k in obj if isinstance(k, str) and k not in skip_keys)
        elif isinstance(obj, frozenset):
            entries += len(obj)  # a snapshot (one batch's ids), replaced, never grown
        elif isinstance(obj, (list, tuple)) or type(obj).__name__ == "deque":
            entries += len(obj)
            stack.extend(x for x in obj if not isinstance(x, (str, bytes, int, float)))
        elif _is_ours(obj) and not isinstance(obj, type):
            attrs = getattr(obj, "__dict__", None)
            if attrs is not None:
                stack.append(attrs)
            for cls in type(obj).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    stack.append(getattr(obj, name, None))
    # The walk counted the attribute dicts' own keys (attribute names): fixed.
    return keyed, entries


def count_our_objects() -> int:
    """Instances of this package's classes the garbage collector tracks."""
    gc.collect()
    return sum(1 for o in gc.get_objects()
               if _is_ours(o) and not isinstance(o, type))


def live_counts(state, live_request_ids) -> dict:
    """The counts for one runner's ``RunnerState`` (see the module doc)."""
    skip_keys = frozenset(live_request_ids) | frozenset(state.finished)
    # The finish notices themselves, the opt-in per-step digests (a record
    # that grows by design while a test reads it) and the counters' last
    # report (keyed by metric names, not requests) are not request state.
    skip_ids = {id(state.finished), id(state.counters_reported)}
    if state.digest is not None:
        skip_ids.add(id(state.digest))
    keyed, entries = walk_counts([state], skip_keys, skip_ids)
    return {"request_keyed": keyed, "containers": entries,
            "objects": count_our_objects()}
