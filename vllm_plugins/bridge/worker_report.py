"""What a worker's step tells the engine core, on the step's output.

After ``Worker.sample_tokens`` (patch ``worker.step_reports``; V1's runner
and V2's alike) these reports ride the step's ``ModelRunnerOutput`` to the
scheduler's ``update_from_output``:

- what our counters grew in the step (``counters.OUTPUT_ATTR``,
  ``bridge/counters.py``);
- the requests whose grammar failed in the step, and AWRS requests' weights
  (``grammar_hold.ERRORS_ATTR``, ``grammar_weights.WEIGHTS_ATTR``): our
  grammar processors report batch rows, which the input batch maps to
  request ids until the next step reorders it (V1's runner; V2's keeps no
  processors there and reports none);
- on Model Runner V2, the k our drafter wants next, or that the engine core
  should choose it (``step_k.OUTPUT_ATTR``, ``bridge/v2/step_k.py``).

They are read and attached in one hook: each hook runs every step after a
forward left its code cold, so a hook costs a step more than its own work.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_plugins.bridge import counters, grammar_weights
from vllm_plugins.bridge.grammar_hold import ERRORS_ATTR, attach_to_output
from vllm_plugins.bridge.v2 import step_k


def wrap_worker_sample_tokens(original):
    # vllm.v1.worker.gpu_worker.Worker.sample_tokens(self, grammar_output)
    # -> ModelRunnerOutput | AsyncModelRunnerOutput (the CPU worker's too):
    # self.model_runner.sample_tokens(grammar_output), the step's output,
    # which the executor takes from the output rank and hands to the
    # scheduler's update_from_output.
    @functools.wraps(original)
    def sample_tokens(self, grammar_output):
        out = original(self, grammar_output)
        runner = self.model_runner
        # Rows name requests only until the next step: taken now, or never.
        errors, weights = grammar_weights.take_reports(getattr(runner, "input_batch", None))
        if out is None or out is _empty_output():
            return out   # nothing reaches the scheduler: counters report later
        grown = counters.runner_growth(runner)
        k = step_k.runner_report(runner)
        if grown or k or errors or weights:
            attach_to_output(out, {counters.OUTPUT_ATTR: grown, step_k.OUTPUT_ATTR: k,
                                   ERRORS_ATTR: errors, grammar_weights.WEIGHTS_ATTR: weights})
        return out

    return sample_tokens


@functools.cache
def _empty_output() -> Any:
    """vLLM's output of a step that sampled nothing (one object), imported
    once: this runs every step."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    return EMPTY_MODEL_RUNNER_OUTPUT
