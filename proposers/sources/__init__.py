"""Draft sources by name: the built-in ones and those other packages add.

A source is a ``DraftSource`` subclass (``base.py``). Built in:

``token_recycling``  Token Recycling's tables: the target's recent top-k
                     successors, grown into a best-first tree.
``ngram``            prompt lookup: the continuations of the latest
                     occurrences of the context's longest repeated suffix.
``suffix``           arctic-inference's ``SuffixDecodingCache`` (the
                     library vLLM's ``suffix`` method uses), with its tree
                     speculation, over the request's prompt and output and
                     a bounded cache of earlier outputs. Optional: present
                     only where ``arctic_inference`` is installed.
``stand``            STAND's per-prompt store of the target's own next-token
                     distributions, shared by the samples of a prompt; its
                     most probable path.

Another package adds a source through the entry-point group
``vllm_plugins.draft_sources`` (name = "module:Class"); the name is then
usable in the hybrid's ``"sources"`` with no change here. A built-in name
cannot be taken by an entry point.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from importlib.metadata import entry_points

from vllm_plugins.proposers.sources.base import DraftSource, SourceTree

logger = logging.getLogger("vllm_plugins")

ENTRY_POINT_GROUP = "vllm_plugins.draft_sources"
BUILTIN: dict[str, str] = {
    "token_recycling": "vllm_plugins.proposers.sources.recycling:RecyclingSource",
    "ngram": "vllm_plugins.proposers.sources.lookup:LookupSource",
    "suffix": "vllm_plugins.proposers.sources.suffix:SuffixSource",
    "stand": "vllm_plugins.proposers.sources.stand:StandSource",
}
# What "sources" defaults to, in this order (the merge breaks ties between
# equal estimates by the order sources are listed).
DEFAULT_SOURCES = ("suffix", "token_recycling", "ngram")
SUFFIX_MISSING = ("draft source 'suffix' needs arctic-inference (pip install "
                  "arctic-inference), which is not installed")
_said_missing = False

__all__ = ["BUILTIN", "DEFAULT_SOURCES", "ENTRY_POINT_GROUP", "DraftSource", "SourceTree",
           "available", "default_sources", "source_class"]


def suffix_available() -> bool:
    return importlib.util.find_spec("arctic_inference") is not None


def _entry_points() -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)
            if ep.name not in BUILTIN}


def available() -> list[str]:
    """Every source name usable here: built in (suffix where installed)
    and from entry points."""
    names = [n for n in BUILTIN if n != "suffix" or suffix_available()]
    return names + sorted(_entry_points())


def default_sources() -> tuple[str, ...]:
    """``DEFAULT_SOURCES`` without suffix where arctic-inference is missing
    (said once per process)."""
    global _said_missing
    if suffix_available():
        return DEFAULT_SOURCES
    if not _said_missing:
        _said_missing = True
        logger.warning("%s; the hybrid's default sources leave it out", SUFFIX_MISSING)
    return tuple(n for n in DEFAULT_SOURCES if n != "suffix")


def source_class(name: str) -> type[DraftSource]:
    """The class of a source name; ValueError names an unknown or
    unavailable one."""
    if name == "suffix" and not suffix_available():
        raise ValueError(SUFFIX_MISSING)
    if name in BUILTIN:
        module, cls = BUILTIN[name].split(":")
        return getattr(importlib.import_module(module), cls)
    ep = _entry_points().get(name)
    if ep is None:
        raise ValueError(f"unknown draft source {name!r}; available: {available()}")
    try:
        cls = ep.load()
    except Exception as e:  # noqa: BLE001 - another package's import, named as such
        raise ValueError(f"draft source {name!r} (entry point {ep.value} in group "
                         f"{ENTRY_POINT_GROUP}) cannot be loaded: {type(e).__name__}: "
                         f"{e}") from None
    if not (isinstance(cls, type) and issubclass(cls, DraftSource)):
        raise ValueError(f"draft source {name!r} (entry point {ep.value}) is not a "
                         f"DraftSource subclass")
    return cls
