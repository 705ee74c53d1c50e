"""Logits processors for vLLM: grammar / JSON-Schema constrained decoding.

``grammar.GrammarLogitsProcessor`` is the vLLM processor (imports vLLM);
``asap`` is its grammar-aligned sampling, ``awrs`` its sample-then-check
mode (``"sampling": "awrs"``). Grammar compilation and matching
live in ``vllm_plugins.grammar``, shared with the grammar-forced draft
proposer. Nothing is imported here, so importing the package is free.
"""
