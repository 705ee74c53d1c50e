"""AWRS weights from the worker to the request's output.

A grammar request with ``"sampling": "awrs", "weights": true`` gets, per
row its processor decides, the log of an estimate of the mass its grammar
allows there (``logits_processors.awrs``). The processor sees batch rows
and a step's candidate positions; the scheduler knows which request a row
was and how many of its tokens the step committed. So, as for matcher
errors (``grammar_hold``): after sampling, the model runner's
``sample_tokens`` puts {request id: the step's log weights by position} on
its ``ModelRunnerOutput``; the scheduler's ``update_from_output`` adds the
first n of them, n being the tokens the request gained in the step, to the
request's total, and when it finishes the request's output carries

    kv_transfer_params["vllm_plugins"] = {"awrs_log_weight": <sum>,
                                          "awrs_tokens": <tokens weighed>}

``kv_transfer_params`` is the one per-request dict vLLM passes from the
engine core to ``RequestOutput`` and to the OpenAI server's responses; a KV
connector's own keys stay as they are. Requests the front end stops itself
(stop strings, aborts) end without it.
"""

from __future__ import annotations

from typing import Any

from vllm_plugins.bridge.processors import grammar_processors

#: ModelRunnerOutput attribute: {request id: [log weight of row 0, 1, ...]}.
WEIGHTS_ATTR = "vllm_plugins_awrs_weights"
#: Scheduler attribute: {request id: [summed log weight, tokens weighed]}.
TOTALS_ATTR = "_vllm_plugins_awrs_totals"
#: The key of our entry in an output's ``kv_transfer_params``.
OUTPUT_KEY = "vllm_plugins"


def take_reports(input_batch: Any) -> tuple[dict[str, str], dict[str, list[float]]]:
    """This step's (matcher errors, AWRS weights) of the grammar processors'
    requests, by request id: what ``sample_tokens`` hands the scheduler,
    read in one pass over the processors (it runs after every step)."""
    procs = getattr(input_batch, "logitsprocs", None)
    if procs is None:
        return {}, {}
    errors: dict[str, str] = {}
    weights: dict[str, list[float]] = {}
    grammar = grammar_processors(procs)
    if not grammar:
        return errors, weights
    req_ids = input_batch.req_ids
    for proc in grammar:
        for out, taken in ((errors, proc.take_failures()), (weights, proc.take_awrs_weights())):
            for index, value in taken.items():
                if index < len(req_ids) and req_ids[index] is not None:
                    out[req_ids[index]] = value
    return errors, weights


def before_update(scheduler: Any, output: Any) -> dict[str, tuple[Any, int]] | None:
    """The weighted requests of this step with their output lengths so far."""
    weights = getattr(output, WEIGHTS_ATTR, None)
    if not weights:
        return None
    seen = {}
    for req_id in weights:
        request = scheduler.requests.get(req_id)
        if request is not None:
            seen[req_id] = (request, request.num_output_tokens)
    return seen


def after_update(scheduler: Any, output: Any, seen: dict[str, tuple[Any, int]] | None,
                 engine_outputs: dict[int, Any]) -> None:
    """Add each request's committed rows' weights; hand finished totals out."""
    totals: dict[str, list] = scheduler.__dict__.setdefault(TOTALS_ATTR, {})
    if seen:
        weights = getattr(output, WEIGHTS_ATTR)
        for req_id, (request, before) in seen.items():
            n = request.num_output_tokens - before
            ws = weights[req_id]
            total = totals.setdefault(req_id, [0.0, 0])
            # A committed row with no weight (never expected) leaves the total unknown.
            total[0] += sum(ws[:n]) if n <= len(ws) else float("nan")
            total[1] += n
    if not totals:
        return
    for outputs in engine_outputs.values():
        for out in outputs.outputs:
            if out.finish_reason is None or out.request_id not in totals:
                continue
            log_w, n = totals.pop(out.request_id)
            params = dict(out.kv_transfer_params or {})
            params[OUTPUT_KEY] = {"awrs_log_weight": log_w, "awrs_tokens": n}
            out.kv_transfer_params = params
    for req_id in [r for r in totals if r not in scheduler.requests]:
        del totals[req_id]  # ended without an output of ours (aborted)
