"""The step's k on Model Runner V2, chosen by our draft-length controller.

V2 verifies one k for every request of a step, and its scheduler picks
that k: the engine's ``num_speculative_tokens``, or by batch size from
vLLM's ``num_speculative_tokens_per_batch_size`` (the scheduler's
``dynamic_sd_lookup``, indexed by the step's request count). Our
``goodput`` controller weighs every k against the step's measured cost
(``goodput.uniform_step_k``) and says which it wants next
(``Drafter.next_step_k``, reported by ``V2Drafter.step_k_report``). The
choice travels the path our counters take:

  worker        ``Worker.sample_tokens`` (patch ``worker.step_reports``),
                after V2's runner sampled and its drafter proposed, puts it
                on the step's ``ModelRunnerOutput`` as ``OUTPUT_ATTR``
  engine core   ``Scheduler.update_from_output`` (``from_output``) makes the
                scheduler's ``dynamic_sd_lookup`` a ``ChosenStepK``: the
                configured k for the batch size (or the engine's) capped by
                the last choice

So the scheduler sets the next step's ``num_spec_tokens_to_schedule`` to it
with no change to its own code, sync or async (an async scheduler reads it
one step later still). A user's schedule stays a cap. Under data
parallelism nothing is reported, as vLLM keeps its own dynamic k off there
(ranks choosing different ks would diverge).

A drafter whose step never waits for the host (the device route) has no
controller in the worker; it reports ``{"engine_core": 1}`` instead, and
the engine core chooses from what it already has (``BatchStepK``: each
request's verified and accepted drafts, the step's time), one step late.
"""

from __future__ import annotations

import functools
import time
from typing import Any

#: ModelRunnerOutput attribute: {"k": the batch-wide k wanted next}, or
#: {"engine_core": 1}: the engine core chooses it.
OUTPUT_ATTR = "vllm_plugins_step_k"


class ChosenStepK:
    """The scheduler's ``dynamic_sd_lookup`` once our controller chose a k:
    ``self[batch_size]`` is the configured k for that batch size, capped
    by ``chosen``. The scheduler only indexes it (and reads it as set)."""

    def __init__(self, configured: list[int] | None, num_spec_tokens: int):
        self.configured = configured
        self.num_spec_tokens = int(num_spec_tokens)
        self.chosen = self.num_spec_tokens
        # The engine core's own choice (a drafter that asked for it).
        self.chooser = None
        self.last_output_at: float | None = None

    def __getitem__(self, batch_size: int) -> int:
        limit = self.num_spec_tokens if self.configured is None else self.configured[batch_size]
        return min(limit, self.chosen)


def from_output(scheduler: Any, scheduler_output: Any, model_runner_output: Any) -> None:
    """After a step's output reached the scheduler: the k our drafter wants
    next, or the engine core's choice where the drafter asked for one,
    becomes the cap of the scheduler's k (installing ``ChosenStepK`` at the
    first report)."""
    report = getattr(model_runner_output, OUTPUT_ATTR, None)
    if not report:
        return
    lookup = scheduler.dynamic_sd_lookup
    if not isinstance(lookup, ChosenStepK):
        lookup = ChosenStepK(lookup, scheduler.num_spec_tokens)
        scheduler.dynamic_sd_lookup = lookup
    if "k" in report:
        k = int(report["k"])
    else:
        k = _engine_core_choice(scheduler, lookup, scheduler_output, model_runner_output)
    lookup.chosen = max(0, min(k, lookup.num_spec_tokens))


def _engine_core_choice(scheduler: Any, lookup: ChosenStepK, scheduler_output: Any,
                        model_runner_output: Any) -> int:
    """``BatchStepK`` on the step that just ended: per request, the drafts
    the scheduler verified and the tokens the step emitted; the time since
    the previous output (a step with requests waiting on it; after an idle
    engine, none)."""
    if lookup.chooser is None:
        from vllm_plugins.proposers.draft_length.batch_k import BatchStepK

        lookup.chooser = BatchStepK(lookup.num_spec_tokens)
    now = time.perf_counter()
    seconds = None if lookup.last_output_at is None else now - lookup.last_output_at
    lookup.last_output_at = now if scheduler.running else None
    spec = scheduler_output.scheduled_spec_decode_tokens
    index = model_runner_output.req_id_to_index
    sampled = model_runner_output.sampled_token_ids
    verified, accepted = [], []
    for req_id in scheduler_output.num_scheduled_tokens:
        i = index.get(req_id)
        if i is None or i >= len(sampled) or not len(sampled[i]):
            continue   # a prefill chunk, or not sampled
        verified.append(len(spec.get(req_id, ())))
        accepted.append(len(sampled[i]) - 1)
    if verified:
        lookup.chooser.observe(verified, accepted, seconds,
                               scheduler_output.total_num_scheduled_tokens)
    return lookup.chooser.choose(len(scheduler.running))


def runner_report(runner: Any) -> dict | None:
    """What the runner's step tells the scheduler of the next k
    (``OUTPUT_ATTR``), where its drafter is ours: read by the worker's
    step hook (``bridge/worker_report.py``) after V2's ``sample_tokens``,
    which has proposed by then."""
    speculator = getattr(runner, "speculator", None)
    if speculator is None or not isinstance(speculator, _v2_drafter()):
        return None
    return speculator.step_k_report()


@functools.cache
def _v2_drafter() -> type:
    """V2Drafter, imported at the first step (the bridge loads this
    module in every vLLM process, the drafter only where a runner drafts)
    and kept: an import statement is code run again at every call."""
    from vllm_plugins.bridge.v2.drafter_base import V2Drafter

    return V2Drafter
