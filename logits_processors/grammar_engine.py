"""Which engines run our grammar processor, and how many of its instances.

vLLM builds entry-point processors and explicitly named ones without
de-duplication, and drops custom processors under speculative decoding
unless our bridge verifies them per position; these rules decide what a
processor instance does in a given engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_plugins.grammar.spec import GRAMMAR_KEY, GrammarSpecError
from vllm_plugins.registry import applies_processors

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig

def engine_drops_processors(vllm_config: "VllmConfig") -> str | None:
    """Why this engine will run no custom logits processors, or None.

    vLLM 0.32's V1 model runner silently drops every custom logits processor,
    entry-point ones included, when speculative decoding is on
    (``build_logitsprocs``; only ``--logits-processors`` given explicitly raises
    ``STR_SPEC_DEC_REJECTS_LOGITSPROCS``), yet the frontend still runs
    ``validate_params``: a grammar request would be admitted and decoded
    unconstrained. The bridge wraps each engine's params validator with
    ``refuse_grammar_requests`` when this returns a reason.
    """
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or vllm_config.use_v2_model_runner:
        return None
    if applies_processors(vllm_config):
        return None
    method = getattr(spec, "method", None)
    return (
        f"speculative decoding ({method}) is on and vLLM's V1 model runner then "
        "runs no custom logits processors; use SamplingParams.structured_outputs "
        "or an engine without speculative decoding"
    )


def refuse_grammar_requests(sampling_params: "SamplingParams", reason: str) -> None:
    """Fail only a request that asks for a grammar this engine cannot honour."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    if GRAMMAR_KEY in extra:
        raise GrammarSpecError(
            f'extra_args["{GRAMMAR_KEY}"] cannot be honoured by this engine: {reason}'
        )


FQCN = "vllm_plugins.logits_processors.grammar:GrammarLogitsProcessor"
_instances_per_config: dict[int, int] = {}


def _times_configured(vllm_config: "VllmConfig") -> int:
    """How many instances vLLM builds per engine: entry point + explicit mentions."""
    from importlib.metadata import entry_points

    n = sum(ep.value.replace(" ", "") == FQCN
            for ep in entry_points(group="vllm.logits_processors"))
    from .grammar import GrammarLogitsProcessor

    for item in vllm_config.model_config.logits_processors or ():
        if item is GrammarLogitsProcessor or (
            isinstance(item, type) and issubclass(item, GrammarLogitsProcessor)
        ):
            n += 1
        elif isinstance(item, str) and item.replace(" ", "") == FQCN:
            n += 1
    return max(n, 1)


def is_duplicate(vllm_config: "VllmConfig") -> bool:
    """True for all but the last of the instances one engine builds.

    vLLM builds entry-point processors and then the ``logits_processors`` list,
    with no de-duplication (``_load_custom_logitsprocs``, V1; ``_load_v2_logitsprocs``,
    V2), one after another for the same config object. Counting construction
    per config modulo the expected number keeps exactly one instance working.
    """
    times = _times_configured(vllm_config)
    if times == 1:
        return False
    key = id(vllm_config)
    ordinal = _instances_per_config.get(key, 0)
    _instances_per_config[key] = ordinal + 1
    return ordinal % times != times - 1
