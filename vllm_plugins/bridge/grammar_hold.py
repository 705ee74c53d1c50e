"""The scheduler's side of our grammar requests: compile off the loop, end on error.

Requests that carry ``extra_args["grammar"]`` (the grammar logits processor's
argument, ``vllm_plugins.grammar.spec.GRAMMAR_KEY``) and nothing else:

* **Hold until compiled.** When the engine core's scheduler receives such a
  request, its matcher starts compiling on the compile pool
  (``vllm_plugins.grammar.compile_cache``), and the request waits in vLLM's
  own blocked-waiting state, ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR``, which
  the scheduler skips without stalling anyone, exactly as it does for its
  own structured outputs. Once the compile is done the request is promoted
  to ``WAITING``; a compile that fails ends it with ``FINISHED_ERROR``
  through the scheduler's own ``grammar_compile_error_reqs``. A grammar
  already compiled in this process is not held at all.
* **End on matcher error.** The grammar processor marks a request whose
  output its grammar can no longer follow; after each step the worker's
  ``sample_tokens`` (``bridge/worker_report.py``) hands those request ids to
  the scheduler on the step's ``ModelRunnerOutput`` (an attribute of ours,
  which pickles with it to a multiprocess executor's scheduler). The
  scheduler drops that step's token of the request and finishes it with
  ``FINISHED_ERROR``: finish reason ``error`` (HTTP 500 from the OpenAI
  server, as for vLLM's own grammar errors), never a silent ``stop``.

A request with vLLM's own structured outputs already waits for vLLM's
grammar; on an engine drafting with ``grammar_forced`` it also waits for the
llguidance matcher the proposer drafts with, compiled on the same pool.

Under vLLM's uniprocess executor the worker runs in the engine-core process
and finds the compiled template in the process-wide cache. With
multiprocess workers (tensor parallel; vLLM's CPU build at any size) the
caches are per process: the step that follows a hold carries the held
specs on its ``SchedulerOutput`` and each worker starts compiling them on
its own pool at once, so when the engine core releases the request the
worker's compile has run alongside it (a worker that is still compiling
then waits for the rest of it, inside that step).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from . import counters, grammar_weights
from .v2 import step_k

logger = logging.getLogger("vllm_plugins")

#: "0" compiles each grammar inside the engine step that first schedules its
#: request, as before the hold existed (to compare the two; default "1").
HOLD_ENV = "VLLM_PLUGINS_GRAMMAR_COMPILE_HOLD"

#: Request attribute: the future of its grammar's compile while it is held.
PENDING_ATTR = "_vllm_plugins_grammar_pending"
#: ModelRunnerOutput attribute: {request id: reason} of this step's matcher errors.
ERRORS_ATTR = "vllm_plugins_grammar_errors"
#: SchedulerOutput attribute: specs of requests held this step, which the
#: workers start compiling at once (their own process's cache).
PRECOMPILE_ATTR = "vllm_plugins_grammar_precompile"



def mark_error(scheduler, req_id: str, message: str) -> None:
    """Have the scheduler finish ``req_id`` with FINISHED_ERROR at its next
    schedule, as it does a grammar vLLM could not compile: a set of request
    ids in vLLM 0.32, a dict of id -> ``vllm.outputs.RequestError`` (whose
    message reaches the client) in 0.33."""
    errors = scheduler.grammar_compile_error_reqs
    if isinstance(errors, dict):
        from vllm.outputs import RequestError

        errors[req_id] = RequestError(code="validation_error",
                                      message=f"Invalid grammar: {message}")
    else:
        errors.add(req_id)

def hold_enabled() -> bool:
    """Whether the hold patches apply: :data:`HOLD_ENV`, read when the
    patches are applied (start-up); a value other than 0 or 1 is refused."""
    raw = os.environ.get(HOLD_ENV, "1").strip()
    if raw not in ("0", "1"):
        raise ValueError(f"{HOLD_ENV} must be 0 or 1, got {raw!r}")
    return raw == "1"


def _grammar_spec(request: Any) -> Any | None:
    from vllm_plugins.grammar.spec import GRAMMAR_KEY

    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None)
    if not extra or GRAMMAR_KEY not in extra:
        return None
    if getattr(request, "structured_output_request", None) is not None:
        return None  # refused by validate_params; vLLM's own grammar governs
    return extra[GRAMMAR_KEY]


def wrap_add_request(original):
    # vllm.v1.core.sched.scheduler.Scheduler.add_request(self, request): a
    # new request id is enqueued by _enqueue_waiting_request, which puts a
    # request in a blocked-waiting status into deferred_waiting.
    @functools.wraps(original)
    def add_request(self, request):
        if request.request_id not in self.requests:
            hold_until_compiled(self, request)
        return original(self, request)

    return add_request


def hold_until_compiled(scheduler: Any, request: Any) -> None:
    from vllm.v1.request import RequestStatus

    from vllm_plugins.grammar.compile_cache import compile_request
    from vllm_plugins.grammar.runtime import engine_runtime

    model_config = scheduler.vllm_config.model_config
    if (request.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
            and _drafts_with_grammar(scheduler.vllm_config)):
        _also_wait_for_draft_grammar(scheduler.vllm_config, request)
        return
    raw = _grammar_spec(request)
    if raw is None or request.status != RequestStatus.WAITING:
        return
    pending = compile_request(raw, lambda: engine_runtime(model_config))
    if pending.done() and pending.exception() is None:
        return
    setattr(request, PENDING_ATTR, pending)
    request.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    # Worker processes (multiprocess executor) compile it meanwhile too.
    scheduler.__dict__.setdefault("_vllm_plugins_precompile", []).append(raw)


def wrap_schedule(original):
    # vllm.v1.core.sched.scheduler.Scheduler.schedule(self, ...) returns the
    # step's SchedulerOutput, which the executor hands to every worker
    # (pickled to worker processes, with an attribute of ours).
    @functools.wraps(original)
    def schedule(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        specs = self.__dict__.pop("_vllm_plugins_precompile", None)
        if specs:
            setattr(out, PRECOMPILE_ATTR, specs)
        return out

    return schedule


def wrap_worker_execute_model(original):
    # vllm.v1.worker.gpu_worker.Worker.execute_model(self, scheduler_output),
    # CPUWorker's too, runs in each worker for every step the engine
    # executes.
    @functools.wraps(original)
    def execute_model(self, scheduler_output, *args, **kwargs):
        specs = getattr(scheduler_output, PRECOMPILE_ATTR, None)
        if specs:
            start_compiles(self.vllm_config.model_config, specs)
        return original(self, scheduler_output, *args, **kwargs)

    return execute_model


def start_compiles(model_config: Any, specs: list) -> None:
    """Start compiling held requests' specs on this process's pool (in the
    engine-core process under a uniprocess executor: the same compile)."""
    from vllm_plugins.grammar.compile_cache import compile_request
    from vllm_plugins.grammar.runtime import engine_runtime

    for raw in specs:
        compile_request(raw, lambda: engine_runtime(model_config))


def _drafts_with_grammar(vllm_config: Any) -> bool:
    """Whether this engine drafts with grammar_forced, whose matcher follows
    vLLM's own structured outputs (and whose drafts a reasoning parser
    switches off)."""
    from vllm_plugins.registry import PLUGIN_OPTIONS_ATTR

    options = getattr(vllm_config.speculative_config, PLUGIN_OPTIONS_ATTR, None)
    so_config = vllm_config.structured_outputs_config
    return (bool(options) and options.get("method") == "grammar_forced"
            and not (getattr(so_config, "reasoning_parser", None)
                     and not getattr(so_config, "enable_in_reasoning", False)))


def _also_wait_for_draft_grammar(vllm_config: Any, request: Any) -> None:
    """A vLLM structured-output request already waits for vLLM's grammar;
    under grammar_forced it also waits for the llguidance matcher the
    proposer drafts with, compiled on the pool (a spec llguidance cannot
    compile only costs the request its forced drafts: it is not an error)."""
    from vllm_plugins.grammar.compile_cache import compile_pool
    from vllm_plugins.grammar.runtime import engine_runtime
    from vllm_plugins.grammar.structured_outputs import grammar_for

    so = request.sampling_params.structured_outputs
    so_config = vllm_config.structured_outputs_config
    model_config = vllm_config.model_config

    def make():
        compiled = grammar_for(so, so_config)
        if compiled is not None:
            engine_runtime(model_config).template(compiled)

    setattr(request, PENDING_ATTR, compile_pool().submit(make))


def wrap_handle_blocked_waiting_request(original):
    # vllm.v1.core.sched.scheduler.Scheduler._handle_blocked_waiting_request(
    #     self, request) -> bool: True when a blocked request may be scheduled
    # now; vLLM's own branch for WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR reads
    # request.structured_output_request, which our requests do not have.
    @functools.wraps(original)
    def _handle_blocked_waiting_request(self, request):
        from vllm.v1.request import RequestStatus

        pending = getattr(request, PENDING_ATTR, None)
        if (pending is None or request.status
                != RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR):
            return original(self, request)
        if not pending.done():
            return False
        if request.structured_output_request is not None:
            delattr(request, PENDING_ATTR)  # our drafts' matcher: vLLM's grammar decides
            return original(self, request)
        error = pending.exception()
        if error is not None:
            logger.warning("request %s: its grammar does not compile in the engine "
                           "(%s: %s); finished with an error", request.request_id,
                           type(error).__name__, error)
            mark_error(self, request.request_id,
                       f"its grammar does not compile: {type(error).__name__}: {error}")
            return False
        delattr(request, PENDING_ATTR)
        request.status = RequestStatus.WAITING
        return True

    return _handle_blocked_waiting_request


@functools.cache
def _output_types():
    """(ModelRunnerOutput, EMPTY_MODEL_RUNNER_OUTPUT), imported once: this
    runs every step."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    return ModelRunnerOutput, EMPTY_MODEL_RUNNER_OUTPUT


def attach_to_output(out: Any, reports: dict[str, dict]) -> None:
    """Merge each {attribute: {key: value}} into the step's output (a
    ModelRunnerOutput now, or an async one when it is read)."""
    output_type, empty = _output_types()
    if isinstance(out, output_type):
        if out is empty:
            return  # nothing was sampled: no request of this step to report
        for attr, values in reports.items():
            if values:
                setattr(out, attr, {**getattr(out, attr, {}), **values})
        return
    get_output = getattr(out, "get_output", None)
    if get_output is None:
        return  # intermediate tensors (pipeline parallel): not the output rank

    def get_output_with_reports():
        result = get_output()
        attach_to_output(result, reports)
        return result

    out.get_output = get_output_with_reports


def wrap_update_from_output(original):
    # vllm.v1.core.sched.scheduler.Scheduler.update_from_output(self,
    # scheduler_output, model_runner_output): request ids in
    # grammar_compile_error_reqs are finished with FINISHED_ERROR and get an
    # output with that finish reason; an empty sampled-token list leaves a
    # running request unchanged (as for a prefill chunk).
    # The AWRS weights of the step's committed tokens are added after it
    # (grammar_weights), and the step's growth of our counters goes onto the
    # SchedulerStats it returns (bridge.counters): update_from_output is the
    # one call that sees both a worker's output and the step's stats. The k
    # our controller wants next on V2 reaches the scheduler here too
    # (bridge.v2.step_k).
    @functools.wraps(original)
    def update_from_output(self, scheduler_output, model_runner_output):
        errors = getattr(model_runner_output, ERRORS_ATTR, None)
        ended = end_on_matcher_errors(self, model_runner_output, errors) if errors else 0
        weighed = grammar_weights.before_update(self, model_runner_output)
        outputs = original(self, scheduler_output, model_runner_output)
        grammar_weights.after_update(self, model_runner_output, weighed, outputs)
        counters.to_scheduler_stats(outputs, model_runner_output, grammar_failures=ended)
        step_k.from_output(self, scheduler_output, model_runner_output)
        return outputs

    return update_from_output


def end_on_matcher_errors(scheduler: Any, output: Any, errors: dict[str, str]) -> int:
    """Ends each running request of ``errors``; returns how many it ended."""
    sampled = output.sampled_token_ids
    ended = 0
    for req_id, reason in errors.items():
        request = scheduler.requests.get(req_id)
        if request is None or request.is_finished():
            continue
        ended += 1
        index = output.req_id_to_index.get(req_id)
        if index is not None and index < len(sampled):
            sampled[index] = []  # the token forced after the error is not output
        logger.warning("request %s: its grammar cannot follow the output (%s); "
                       "finished with an error", req_id, reason)
        mark_error(scheduler, req_id, f"its grammar cannot follow the output: {reason}")
    return ended
