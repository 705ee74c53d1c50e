"""Self-speculation with the target's own layers: SWIFT (layer skip) and DEL
(dynamic early exit). The partial forwards live in the bridge
(vllm_plugins.bridge.v1.target_layers); their plan types in vllm_plugins.self_draft."""
