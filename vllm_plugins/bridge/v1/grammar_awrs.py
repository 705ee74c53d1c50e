"""AWRS's unseeded rows drawn by vLLM's own sampler, checked after it.

``"sampling": "awrs"`` draws a token, checks it, and draws again only on a
refusal. For an unseeded row with no truncation, vLLM's sampler makes the
first draw anyway, from the same row: so the model runner's ``_sample``
(wrapped in ``bridge.v1.runner``) tells our grammar processors before the
step that it will follow up (``awrs_defer``), the processors leave those
rows as they are, and after vLLM has sampled, each checks the tokens drawn
there and, on a refusal, draws on without it (``AwrsRows.awrs_after_sample``),
before the runner records the step's tokens. The processor pays a check per
row instead of a draw over the whole vocabulary.
"""

from __future__ import annotations

from typing import Any

from vllm_plugins.bridge.processors import grammar_processors


def before_sample(runner: Any, plain: bool) -> tuple:
    """The step's grammar processors, told whether this step is followed up:
    only a step sampled by the plain sampler (``plain``: no drafts to
    verify, one row a request) is."""
    batch = getattr(runner, "input_batch", None)
    procs = getattr(batch, "logitsprocs", None)
    if procs is None:
        return ()
    grammar = grammar_processors(procs)
    for proc in grammar:
        proc.awrs_defer = plain
    return grammar


def after_sample(grammar: tuple, sampler_output: Any) -> None:
    """Check (and where refused, redraw) the tokens of the rows left to vLLM."""
    if not grammar or sampler_output is None:
        return
    for proc in grammar:
        proc.awrs_after_sample(sampler_output.sampled_token_ids)
