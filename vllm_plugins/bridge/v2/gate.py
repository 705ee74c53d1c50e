"""Which runner serves our methods: V2 where it can, V1 where it cannot.

``VllmConfig._get_v2_model_runner_unsupported_features`` is vLLM's own list
of what keeps V2 off; it names ``custom_class``, the route our methods take
to the V1 runner. Ours are taken off that list where V2 serves them, and
where it does not, the list names our method and the reason instead. vLLM's
``use_v2_model_runner`` then does the rest as for its own features: V1 with
one warning while V1 exists, and with ``VLLM_USE_V2_MODEL_RUNNER=1`` an
error at start-up that names the reason.
"""

from __future__ import annotations

import functools

from vllm_plugins.registry import METHODS, PLUGIN_OPTIONS_ATTR

CUSTOM_CLASS_ENTRY = "speculative method 'custom_class'"


def plugin_options(vllm_config) -> dict | None:
    """Our resolved options on this engine's speculative config, or None."""
    spec = getattr(vllm_config, "speculative_config", None)
    return getattr(spec, PLUGIN_OPTIONS_ATTR, None) if spec is not None else None


def v2_refusal(options: dict) -> str | None:
    """Why V2 cannot serve our method with these options (None: it can)."""
    name = options["method"]
    return METHODS[name].proposer_class().runner_v2_refusal(options)


def wrap_unsupported_features(original):
    # VllmConfig._get_v2_model_runner_unsupported_features(self) -> list[str]
    @functools.wraps(original)
    def unsupported(self):
        features = original(self)
        options = plugin_options(self)
        if options is None:
            return features
        features = [f for f in features if f != CUSTOM_CLASS_ENTRY]
        why = v2_refusal(options)
        if why is not None:
            features.append(f"speculative method '{options['method']}' "
                            f"(vllm-plugins), which {why}")
        return features

    return unsupported
