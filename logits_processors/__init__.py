"""Logits processors for vLLM: grammar / JSON-Schema constrained decoding.

``grammar.GrammarLogitsProcessor`` is the vLLM processor (imports vLLM);
``spec`` parses and compiles the per-request ``extra_args["grammar"]`` and
needs only llguidance. Nothing is imported here, so importing the package is free.
"""
