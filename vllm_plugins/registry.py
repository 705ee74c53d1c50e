"""Our method names, and the one place that turns them into vLLM's route.

A user writes ``{"method": "token_recycling", ...}``. vLLM 0.32 knows only its
own method names, plus ``custom_class`` with a dotted class path in ``model``.
``translate`` rewrites the user's dict into that form and returns our options,
which the engine-args patch in ``vllm_plugins.bridge`` attaches to the config.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from vllm_plugins.options import resolve

PLUGIN_OPTIONS_ATTR = "vllm_plugins_options"
# vllm.v1.sample.rejection_sampler.MAX_SPEC_LEN: the rejection sampler
# asserts max_spec_len <= MAX_SPEC_LEN in the middle of serving, so more
# drafts are refused at start-up (pinned by tests/test_options.py).
MAX_NUM_SPECULATIVE_TOKENS = 128


@dataclass(frozen=True)
class Method:
    name: str
    class_path: str  # "module.Class" of a PluginProposer subclass

    def proposer_class(self):
        module, cls = self.class_path.rsplit(".", 1)
        return getattr(importlib.import_module(module), cls)


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("token_recycling",
               "vllm_plugins.proposers.token_recycling.TokenRecyclingProposer"),
        Method("ngram_adaptive",
               "vllm_plugins.proposers.ngram_adaptive.NgramAdaptiveProposer"),
        Method("stand", "vllm_plugins.proposers.stand.StandProposer"),
        Method("swift", "vllm_plugins.proposers.layer_skip.swift.SwiftProposer"),
        Method("del", "vllm_plugins.proposers.layer_skip.del_.DelProposer"),
        Method("grammar_forced", "vllm_plugins.proposers.grammar.GrammarProposer"),
        Method("hybrid", "vllm_plugins.proposers.hybrid.HybridProposer"),
    )
}
BY_CLASS_PATH = {m.class_path: m for m in METHODS.values()}
# Class paths of earlier releases: a custom_class config naming one still
# reaches the method (vLLM is handed the current path).
BY_CLASS_PATH.update({
    "vllm_plugins.proposers.vllm_ngram.AdaptiveNgramProposer": METHODS["ngram_adaptive"],
    "vllm_plugins.proposers.layer_skip.dynamic_exit.DynamicExitProposer": METHODS["del"],
})
# vLLM SpeculativeConfig fields our methods pass through to vLLM that a
# vLLM release may lack, with what each does: on such a vLLM the key is
# refused by name rather than read as an unknown option of ours.
VLLM_FIELDS_BY_RELEASE = {
    "num_speculative_tokens_per_batch_size":
        "the step's num_speculative_tokens chosen by batch size (dynamic "
        "speculative decoding, served by Model Runner V2)",
}
# Names vLLM has taken or is taking upstream (an open prototype uses
# "grammar"): where vLLM does not define them, a user who types one learns ours.
RENAMED = {"grammar": "grammar_forced"}


def applies_processors(vllm_config) -> bool:
    """True for an engine whose drafter is one of ours: logits processors
    then apply at every verified row (on the V1 runner through
    ``vllm_plugins.bridge.v1.verify_processors``; V2's own sampler applies
    them), and our grammar processor runs under speculation."""
    spec = getattr(vllm_config, "speculative_config", None)
    return spec is not None and getattr(spec, PLUGIN_OPTIONS_ATTR, None) is not None


def register_method(name: str, class_path: str) -> None:
    """Lets other packages add methods through the same route."""
    m = Method(name, class_path)
    METHODS[name] = m
    BY_CLASS_PATH[class_path] = m


def vllm_speculative_fields() -> set[str]:
    from dataclasses import fields

    from vllm.config import SpeculativeConfig

    return {f.name for f in fields(SpeculativeConfig)}


def vllm_method_names() -> set[str]:
    """The method names vLLM's own SpeculativeConfig accepts."""
    from typing import get_args

    from vllm.config.speculative import SpeculativeMethod

    names, todo = set(), [SpeculativeMethod]
    while todo:
        for arg in get_args(todo.pop()):
            (names.add if isinstance(arg, str) else todo.append)(arg)
    return names


def translate(user: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(dict for vLLM's SpeculativeConfig, our validated options or None).

    A name vLLM itself defines is always vLLM's: ours never shadow it
    (``custom_class`` with one of our class paths is ours, with defaults).
    """
    user = {k.replace("-", "_"): v for k, v in user.items()}
    method_name = user.get("method")
    if (isinstance(method_name, str) and method_name != "custom_class"
            and method_name in vllm_method_names()):
        return user, None
    if isinstance(method_name, str) and method_name in RENAMED:
        raise ValueError(
            f"speculative method '{method_name}' is '{RENAMED[method_name]}' in "
            f"vllm-plugins (vLLM reserves '{method_name}' for a method of its own)")
    method = METHODS.get(method_name) if isinstance(method_name, str) else None
    if method is None:
        # The dotted custom_class route to one of our classes: defaults apply.
        model = user.get("model")
        method = BY_CLASS_PATH.get(model) if isinstance(model, str) else None
        if method is None or user.get("method") not in (None, "custom_class"):
            return user, None
    cls = method.proposer_class()
    declared = {o.name for o in cls.OPTIONS}
    vllm_fields = vllm_speculative_fields()
    missing = sorted(set(user) & (set(VLLM_FIELDS_BY_RELEASE) - vllm_fields - declared))
    if missing:
        import vllm

        key = missing[0]
        raise ValueError(
            f"speculative_config '{key}' ({VLLM_FIELDS_BY_RELEASE[key]}) is a vLLM "
            f"option that vLLM {vllm.__version__} does not have; remove it, or use a "
            f"vLLM whose SpeculativeConfig has it")
    # A declared option wins over a vLLM field of the same name.
    ours = {k: v for k, v in user.items() if k not in vllm_fields or k in declared}
    rest = {k: v for k, v in user.items() if k not in ours}
    options = resolve(method.name, cls.OPTIONS, ours)
    cls.check_options(method.name, options)
    if options["draft_length"] != "fixed":
        # Validated here, before any model loads; the worker builds it again.
        from vllm_plugins.proposers.draft_length import policy_options

        policy_options(options["draft_length"], options["draft_length_options"])
    options["method"] = method.name
    if rest.get("num_speculative_tokens") is None:
        rest["num_speculative_tokens"] = cls.DEFAULT_NUM_SPECULATIVE_TOKENS
    num = rest["num_speculative_tokens"]
    if (isinstance(num, bool) or not isinstance(num, int)
            or not 1 <= num <= MAX_NUM_SPECULATIVE_TOKENS):
        raise ValueError(
            f"speculative_config 'num_speculative_tokens' of method '{method.name}' "
            f"must be an integer in [1, {MAX_NUM_SPECULATIVE_TOKENS}] (vLLM's "
            f"rejection sampler verifies at most {MAX_NUM_SPECULATIVE_TOKENS} drafts "
            f"per request), got {num!r}")
    rest["method"] = "custom_class"
    rest["model"] = method.class_path
    return rest, options


def engine_sources(options: dict) -> tuple[str, ...] | None:
    """The hybrid sources an engine with our ``options`` runs (directly, or
    as the ``inner`` of a composing method), for the admission check of
    per-request options; None for an engine without sources."""
    cls = METHODS[options["method"]].proposer_class()
    inner = options.get("inner")
    if isinstance(inner, str):
        inner = {"method": inner}
    if isinstance(inner, dict) and isinstance(inner.get("method"), str) \
            and inner["method"] in METHODS:
        cls, options = METHODS[inner["method"]].proposer_class(), inner
        options = {"sources": None, **options}
    sources = getattr(cls, "engine_sources", None)
    return None if sources is None else sources(options)
