"""Model Runner V2 (``vllm/v1/worker/gpu/``): our proposers as a V2 drafter.

V2 builds its drafter in ``spec_decode.init_speculator``, a fixed choice
over vLLM's own methods; ``gate`` lets V2 take our methods where it can
serve them (vLLM otherwise sends ``custom_class`` to the V1 runner), and
``speculator`` is the drafter it then builds: a ``BaseSpeculator`` around
our proposer, fed by ``taps`` (the target's top-k at verified rows, each
request's sampling parameters) and ``context`` (the step's
``StepContext``, from V2's ``InputBatch`` and ``RequestState``).
"""
