"""Start-up: our method names into vLLM's config, and every refusal up front.

What cannot work is refused here, in the front end, before a model loads:
one ``ValueError`` that names the option and the reason, never a failure
later in a worker.
"""

from __future__ import annotations

import functools

from vllm_plugins.registry import PLUGIN_OPTIONS_ATTR, translate


def wrap_create_speculative_config(original):
    # vllm.engine.arg_utils.EngineArgs.create_speculative_config(
    #     self, target_model_config, target_parallel_config) builds
    # SpeculativeConfig(**self.speculative_config); it runs after plugins load.
    @functools.wraps(original)
    def create_speculative_config(self, *args, **kwargs):
        options = None
        if isinstance(self.speculative_config, dict):
            self.speculative_config, options = translate(self.speculative_config)
        config = original(self, *args, **kwargs)
        if config is not None and options is not None:
            parallel = (args[1] if len(args) > 1
                        else kwargs.get("target_parallel_config"))
            refuse_unsafe(options["method"], config, parallel)
            # SpeculativeConfig forbids unknown fields in __init__, but the
            # instance has a __dict__, which pickles to the workers with it.
            object.__setattr__(config, PLUGIN_OPTIONS_ATTR, options)
        return config

    return create_speculative_config


def wrap_refuse_our_methods(original):
    # As wrap_create_speculative_config, on a vLLM the bridge was not checked
    # against: our method names are refused, everything else is vLLM's.
    @functools.wraps(original)
    def create_speculative_config(self, *args, **kwargs):
        if isinstance(self.speculative_config, dict):
            refuse_our_method(self.speculative_config)
        return original(self, *args, **kwargs)

    return create_speculative_config


def refuse_our_method(user: dict) -> None:
    """ValueError, with ``vllm_plugins.unsupported_vllm``'s reason, for a
    speculative config that names one of our methods."""
    from vllm_plugins import unsupported_vllm
    from vllm_plugins.registry import BY_CLASS_PATH, METHODS, vllm_method_names

    method, model = user.get("method"), user.get("model")
    try:
        vllm_names = vllm_method_names()
    except Exception:  # noqa: BLE001 - a vLLM whose method list moved
        vllm_names = set()
    ours = ((isinstance(method, str) and method in METHODS and method not in vllm_names)
            or (method in (None, "custom_class") and isinstance(model, str)
                and model in BY_CLASS_PATH))
    reason = unsupported_vllm()
    if ours and reason is not None:
        raise ValueError(f"speculative method {method if method != 'custom_class' else model!r} "
                         f"is vllm-plugins', which is off: {reason}")


def refuse_unsafe(method: str, speculative_config, parallel_config) -> None:
    """Combinations our methods cannot serve exactly, refused by name.
    (Which model runner serves them is vLLM's choice, informed by
    ``bridge.v2.gate``.)"""
    where = f"speculative method '{method}' (vllm-plugins)"
    sample_method = getattr(speculative_config, "rejection_sample_method", "standard")
    if sample_method != "standard":
        raise ValueError(
            f"{where} is verified by vLLM's standard rejection sampler, which "
            "keeps the output exact; rejection_sample_method "
            f"'{sample_method}' is not supported with it")
    if parallel_config is not None:
        # Tensor parallel is served: ranks draft alike (bridge/ranks.py).
        # Data parallel is served by methods that draft from tokens and
        # logits only: each rank is an engine of its own.
        unsafe = dict(_UNSAFE_PARALLEL)
        if self_drafting(speculative_config):
            unsafe["data_parallel_size"] = _SELF_DRAFT_DATA_PARALLEL
        for name, why in unsafe.items():
            size = int(getattr(parallel_config, name, 1) or 1)
            if size > 1:
                raise ValueError(f"{where} cannot serve {name}={size}: {why}; "
                                 f"use {name}=1 (tensor parallel is supported)")


# Parallel layouts our methods refuse, and why (docs/architecture.md, "Ranks").
_UNSAFE_PARALLEL = {
    "pipeline_parallel_size":
        "the proposer runs on every stage but only the last stage has the "
        "target's logits (no top-k to learn from, no verified rows for "
        "self-drafting), and self-drafting would run layers other stages hold",
}
# Why self-drafting methods (swift, del, and grammar_forced around them)
# refuse data parallel; the others draft from tokens and logits only.
_SELF_DRAFT_DATA_PARALLEL = (
    "a self-drafting method runs the target's layers to draft, and with a MoE "
    "target data-parallel engines step in lockstep, each forward joining "
    "vLLM's cross-rank batch coordination: draft forwards that some ranks "
    "run and others do not would hang it; methods that draft from tokens "
    "and logits (token_recycling, stand, hybrid, ngram_adaptive, and "
    "grammar_forced around them) serve data parallel")


def wrap_params_validator(original):
    # vllm.v1.engine.input_processor.InputProcessor
    #     ._build_logits_processors_params_validator(self) -> Callable[[SamplingParams], None]
    # is built once per engine in the front end, with that engine's config.
    # Its validator admits a request's extra_args["speculation"] against this
    # engine's speculative config (refused by name where the engine does not
    # draft with our methods). With speculative decoding the V1 runner drops
    # custom logits processors, so a grammar request would be decoded
    # unconstrained: this engine's validator refuses it instead.
    @functools.wraps(original)
    def build_validator(self):
        validate = original(self)
        from vllm_plugins.logits_processors.grammar import (
            engine_drops_processors, refuse_grammar_requests)
        from vllm_plugins.proposers.sources.request import admit

        reason = engine_drops_processors(self.vllm_config)
        engine, engine_method = speculation_engine(self.vllm_config)

        def validate_request(params):
            # vllm.exceptions.VLLMValidationError is what the server answers
            # with HTTP 400 (vLLM converts validate_params' ValueErrors too).
            from vllm.exceptions import VLLMValidationError

            try:
                admit(params, engine, engine_method)
                if reason is not None:
                    refuse_grammar_requests(params, reason)
            except ValueError as e:
                raise VLLMValidationError(str(e)) from e
            validate(params)

        return validate_request

    return build_validator


def wrap_validate_spec_decode(original):
    # vllm.sampling_params.SamplingParams._validate_spec_decode(self,
    #     speculative_config): refuses min_p and logit_bias when speculating.
    # Engines drafting with our methods serve them on either runner: V1's
    # verified rows get them from v1/verify_processors, V2's from its own
    # sampler.
    @functools.wraps(original)
    def _validate_spec_decode(self, speculative_config):
        if (speculative_config is not None
                and getattr(speculative_config, PLUGIN_OPTIONS_ATTR, None) is not None):
            return None  # applied per verified row (see above)
        return original(self, speculative_config)

    return _validate_spec_decode


def speculation_engine(vllm_config):
    """((our method, num_speculative_tokens, hybrid sources or None) or None,
    the engine's speculative method or None): what a request's
    ``extra_args["speculation"]`` is admitted against."""
    from vllm_plugins.registry import engine_sources

    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return None, None
    options = getattr(spec, PLUGIN_OPTIONS_ATTR, None)
    if options is None:
        return None, getattr(spec, "method", None)
    return ((options["method"], int(spec.num_speculative_tokens),
             engine_sources(options)), options["method"])


def wrap_lookahead(original: property) -> property:
    # vllm.config.VllmConfig.num_lookahead_tokens (property): KV slots the
    # scheduler (allocate_slots) and the worker warmup reserve past the tokens
    # the target runs. Self-drafting methods write their drafts' K/V there,
    # as vLLM's EAGLE does.
    def num_lookahead_tokens(self) -> int:
        return max(original.fget(self), plugin_lookahead(self.speculative_config))

    return property(num_lookahead_tokens)


def plugin_lookahead(speculative_config) -> int:
    """num_speculative_tokens for our methods that draft with the target's
    own layers (they write draft K/V); 0 for every other configuration."""
    if not self_drafting(speculative_config):
        return 0
    return int(speculative_config.num_speculative_tokens or 0)


def self_drafting(speculative_config) -> bool:
    """Whether our method drafts with the target's own layers (its class,
    or a composing method's ``inner`` class, declares ``SELF_DRAFT``)."""
    options = getattr(speculative_config, PLUGIN_OPTIONS_ATTR, None)
    if options is None:
        return False
    from vllm_plugins.registry import METHODS

    classes = [METHODS[options["method"]].proposer_class()]
    # A composing method drafts with its "inner" method's class too.
    inner = options.get("inner")
    inner = inner.get("method") if isinstance(inner, dict) else inner
    if isinstance(inner, str) and inner in METHODS:
        classes.append(METHODS[inner].proposer_class())
    return any(cls.SELF_DRAFT for cls in classes)
