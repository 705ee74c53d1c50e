"""The V1 model runner (``vllm/v1/worker/gpu_model_runner.py``, the CPU
runner's base): our proposers through vLLM's ``custom_class`` route.

``runner`` wraps the runner's step (the patches named ``runner.*`` and
``tree.*``); ``step`` builds the ``StepContext`` from the runner's arrays;
``tree_step`` verifies tree drafts; ``target_layers`` runs the target's own
layers for self-drafting methods (SWIFT, DEL); ``verify_processors`` applies
logits processors at every verified row; ``grammar_awrs`` leaves AWRS rows
to vLLM's draw and checks them after. Trees and self-drafting exist only
here: V2 refuses them at start-up (``Drafter.runner_v2_refusal``).
"""
