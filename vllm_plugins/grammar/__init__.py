"""Grammars on llguidance: one home for compiling and matching them.

Both users import from here: the grammar logits processor
(``vllm_plugins.logits_processors``) and the grammar-forced draft proposer
(``vllm_plugins.proposers.grammar``).

* ``spec``: our per-request spec, ``SamplingParams.extra_args["grammar"]``:
  parsing, validation, compilation to llguidance grammar text (cached);
* ``structured_outputs``: vLLM's own ``StructuredOutputsParams`` to the same
  kind of grammar text, as the request's vLLM backend builds it;
* ``runtime``: per-process llguidance state: the tokenizer, matchers built
  from cached templates, token bitmasks applied to logits rows;
* ``checks``: token checks (a function of the text so far and a candidate
  token) registered by other packages, for the AWRS sampling mode.

Nothing is imported here, so importing the package is free; ``spec`` and
``structured_outputs`` need only llguidance, ``runtime`` needs torch too.
"""
