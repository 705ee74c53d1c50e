"""Grammar compilation off the engine loop: one compile per distinct grammar.

A grammar request's matcher (``llguidance.LLMatcher``) is built from its
grammar text and the engine's llguidance tokenizer; for a large schema that
takes long enough to stall every running request if it happens inside an
engine step. So, as vLLM's own structured-output manager does
(``StructuredOutputManager.grammar_init``), the engine core starts the
compile on a thread pool when the request arrives, and the scheduler holds
the request in waiting until it is done (``vllm_plugins.bridge.grammar_hold``).
The worker, in the same process under vLLM's uniprocess executor, then finds
the compiled template in the process-wide caches here and copies it.

llguidance releases the GIL while it compiles (``tests/test_grammar_compile.py``
measures the engine thread's progress during a compile), so a thread is
enough: the engine loop keeps running Python while the pool compiles.

Two caches, both keyed by text and shared by every thread of the process:

* ``OnceCache``: values computed at most once per key. A caller that asks
  for a key another thread is computing waits for that result rather than
  computing it again; a failed computation is not kept (the next caller
  tries again).
* the request-level cache of :func:`compile_request`: the whole path from a
  request's ``extra_args["grammar"]`` to a matcher template, run on the pool.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, Callable, Hashable

# Requests whose compile was started here, by the canonical text of their
# spec. Each holds its matcher template, the same object as the runtime's
# template cache (grammar.runtime): the same bound keeps them to about the
# same set.
_REQUEST_CACHE_SIZE = 256


class OnceCache:
    """An LRU of futures: each key's value is computed once, by one caller."""

    def __init__(self, size: int):
        self.size = size
        self._lock = threading.Lock()
        self._items: OrderedDict[Hashable, Future] = OrderedDict()
        _CACHES.add(self)

    def _after_fork(self) -> None:
        # A compile in flight in the parent never finishes in the child.
        self._lock = threading.Lock()
        for key in [k for k, f in self._items.items() if not f.done()]:
            del self._items[key]

    def _claim(self, key: Hashable) -> tuple[Future, bool]:
        with self._lock:
            fut = self._items.get(key)
            if fut is not None:
                self._items.move_to_end(key)
                return fut, False
            fut = self._items[key] = Future()
            while len(self._items) > self.size:
                self._items.popitem(last=False)
            return fut, True

    def _run(self, key: Hashable, fut: Future, make: Callable[[], Any]) -> None:
        try:
            value = make()
        except BaseException as e:  # noqa: BLE001 - handed to every waiter
            with self._lock:
                if self._items.get(key) is fut:
                    del self._items[key]
            fut.set_exception(e)
        else:
            fut.set_result(value)

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The value for ``key``: computed here if no one has, else awaited."""
        fut, mine = self._claim(key)
        if mine:
            self._run(key, fut, make)
        return fut.result()

    def submit(self, key: Hashable, make: Callable[[], Any]) -> Future:
        """A future of the value for ``key``, computed on the compile pool if new.

        ``make`` must not wait for another ``submit``'s future (the pool may
        have a single thread); waiting in ``get`` is fine: a value being
        computed there is computed by a thread that is running.
        """
        fut, mine = self._claim(key)
        if mine:
            compile_pool().submit(lambda: self._run(key, fut, make))
        return fut

    def peek(self, key: Hashable) -> Future | None:
        with self._lock:
            return self._items.get(key)

    def __len__(self) -> int:
        return len(self._items)


_CACHES: weakref.WeakSet[OnceCache] = weakref.WeakSet()
#: Stack of the threads that compile. llguidance recurses on the calling
#: thread's stack, both in its JSON Schema conversion (through ``$ref``
#: chains) and when it builds a matcher: a chain of a few thousand
#: definitions overflows a default 8 MiB stack and kills the process (the
#: API server in validate_params, or the engine), while on this stack
#: llguidance's own size limit refuses such a schema first
#: (``tests/test_grammar_compile.py``). Reserved, not committed: a thread
#: touches only the stack it uses.
DEEP_STACK_BYTES = 256 * 2**20
_THREAD_PREFIX = "vllm-plugins-grammar"


class _Pool:
    """Threads with :data:`DEEP_STACK_BYTES` stacks, created up front (a
    thread's stack size is fixed when it is created)."""

    def __init__(self, threads: int, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        previous = threading.stack_size(DEEP_STACK_BYTES)
        try:
            for i in range(threads):
                threading.Thread(target=self._serve, name=f"{_THREAD_PREFIX}-{name}-{i}",
                                 daemon=True).start()
        finally:
            threading.stack_size(previous)

    def _serve(self) -> None:
        while True:
            fut, fn = self._jobs.get()
            _settle(fut, fn)

    def submit(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        self._jobs.put((fut, fn))
        return fut


_POOLS: dict[str, _Pool] = {}
_POOL_LOCK = threading.Lock()


def _pool(name: str, threads: int) -> _Pool:
    with _POOL_LOCK:
        pool = _POOLS.get(name)
        if pool is None:
            pool = _POOLS[name] = _Pool(threads, name)
        return pool


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def compile_pool() -> _Pool:
    """The process's compile threads: half the cores, at least one (vLLM's
    structured-output manager sizes its pool the same way: compiling is CPU
    work, and the engine needs the other half). Not niced: a niced compile
    starves behind a busy engine, and its held request with it."""
    return _pool("compile", max(1, (_cores() + 1) // 2))


def on_deep_stack(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a compile-sized stack: here when this is a compile thread,
    else on a thread of its own while the caller waits (not queued behind
    the pool's compiles)."""
    if threading.current_thread().name.startswith(_THREAD_PREFIX):
        return fn()
    return _pool("inline", 1).submit(fn).result()


def _reset_after_fork() -> None:
    """vLLM forks engine processes from a process that may have compiled
    already: the child has none of the parent's threads, so it starts its
    own pools, and drops the compiles the parent had in flight."""
    global _POOL_LOCK
    _POOL_LOCK = threading.Lock()
    _POOLS.clear()
    for cache in list(_CACHES):
        cache._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


_REQUESTS = OnceCache(_REQUEST_CACHE_SIZE)


def spec_text(raw: Any) -> str | None:
    """The canonical text of a request's ``extra_args["grammar"]``: the string
    itself, or a dict's JSON text in its own key order (property order is
    meaningful to llguidance). None when it cannot be written (too deep, not
    JSON): such a spec is compiled without caching, to report its error."""
    if isinstance(raw, str):
        return raw
    try:
        return json.dumps(raw, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None


def compile_request(raw: Any, runtime: Callable[[], Any]) -> Future:
    """Start compiling ``extra_args["grammar"]`` (``raw``) for the runtime that
    ``runtime()`` returns (built on the pool too: its tokenizer takes seconds);
    a future of the matcher template. A spec already compiled in this process
    returns a finished future at once."""

    def make():
        from vllm_plugins.grammar.spec import compile_grammar_request

        rt = runtime()
        return rt.template(compile_grammar_request(raw))

    key = spec_text(raw)
    if key is None:
        return compile_pool().submit(make)
    return _REQUESTS.submit(key, make)


def _settle(fut: Future, make: Callable[[], Any]) -> None:
    try:
        fut.set_result(make())
    except BaseException as e:  # noqa: BLE001 - the scheduler reports it
        fut.set_exception(e)
