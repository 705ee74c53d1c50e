"""A request preempted by vLLM leaves the batch without finishing and comes
back later in prefill: its whole context (prompt and output so far) is
computed again, then it decodes on. How the bridge shows that to a proposer
(vllm_plugins.bridge.v1.step.build_context): the request is absent from
``ctx.requests`` while it waits (vLLM's runner removes unscheduled requests
from its input batch), it is never in ``ctx.finished``, and on its return
its rows carry no accepted tokens (``in_prefill``) until the prefill ends; the
step that ends it verified no drafts (``num_draft`` 0), since vLLM dropped the
drafts it had when it was preempted (``Scheduler._preempt_request`` clears
``spec_token_ids``).

So: state of a request that comes back is still its own (not double
counted), drafts it never had verified teach nothing, and a request gone
long enough to be swept is rebuilt on its return.
"""

from types import SimpleNamespace

import numpy as np

from tests.test_stand import proposer, req
from vllm_plugins.proposers.stand import StandProposer
from vllm_plugins.step_context import StepContext

PROMPT = [1, 2, 3, 4]
TOPK = [[(5, 0.9)], [(6, 0.9)]]


def _decode(p, out, accepted=1, num_draft=0, topk=None, others=()):
    """One step in which request "a" emitted the last ``accepted`` tokens of
    ``out`` after ``num_draft`` verified drafts."""
    ctx_tokens = PROMPT + out
    verified = ctx_tokens[len(ctx_tokens) - accepted - 1:][:num_draft + 1]
    r = req("a", ctx_tokens, out[len(out) - accepted:], verified=verified,
            topk=topk, num_prompt=len(PROMPT))
    return p.step(StepContext([r, *others], max_draft=3))


def _other(i):
    return req("b", [9, 9, 9, 9 + i], [9 + i], verified=[9], num_prompt=3)


def _prefill(p, out):
    r = req("a", PROMPT + out, [], num_prompt=len(PROMPT))
    return p.step(StepContext([r, _other(0)], max_draft=3))


def test_stand_request_back_from_preemption_keeps_its_store_and_learns_nothing_unverified():
    p = proposer(share="prompt", calibrate=True, max_order=1)
    _decode(p, [5, 6], accepted=2, num_draft=1, topk=TOPK)  # 4 -> 5, 5 -> 6 learned
    d = _decode(p, [5, 6, 5])
    assert d.tokens[0]  # drafts after 5, handed to vLLM ...
    trials = p.calibration.trials.copy()
    key = p._req_key["a"]
    # ... which preempts "a" before verifying them: it waits, then re-prefills.
    for i in range(3):
        p.step(StepContext([_other(i)], max_draft=3))
    _prefill(p, [5, 6, 5])
    _prefill(p, [5, 6, 5])  # chunked: still no token
    d = _decode(p, [5, 6, 5, 5])  # prefill done: one token, no drafts verified
    assert (p.calibration.trials == trials).all()  # the lost drafts taught nothing
    assert p._req_key["a"] == key and p._live[key] == 1 and len(p.stores) == 2
    assert d.tokens[0]  # drafting resumes from the same store
    assert p.metrics()["num_errors"] == 0


def test_stand_request_swept_while_preempted_is_rebuilt_on_return():
    p = proposer(share="prompt", max_order=1)
    _decode(p, [5, 6], accepted=2, num_draft=1, topk=TOPK)
    key = p._req_key["a"]
    for i in range(StandProposer.SWEEP_STEPS + 64):
        p.step(StepContext([_other(i)], max_draft=3))
    assert "a" not in p._req_key and key not in p._live and p.swept_requests == 1
    _prefill(p, [5, 6])
    d = _decode(p, [5, 6, 5])
    assert p._req_key["a"] == key and p._live[key] == 1  # counted once again
    assert d.tokens[0] == [6, 5, 6][:len(d.tokens[0])] and d.tokens[0]
    p.step(StepContext([], finished={"a", "b"}, max_draft=3))
    assert not p._req_key and not p._live


def test_grammar_matcher_follows_a_request_back_from_preemption(model_path):
    """The matcher has read the output before preemption; on return the
    context holds the same output and it reads on from there: the same
    drafts as a request never preempted."""
    from transformers import AutoTokenizer
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    from vllm_plugins.proposers.grammar import GrammarProposer
    from vllm_plugins.step_context import RequestStep

    tok = AutoTokenizer.from_pretrained(model_path)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(
        choice=["alpha beta gamma delta"]))
    prompt = tok.encode("Say it:", add_special_tokens=False)
    text = tok.encode("alpha beta gamma delta", add_special_tokens=False)

    def drafts(preempted: bool) -> list[list[int]]:
        p = GrammarProposer(None, options={}, vocab_size=49152, tokenizer=tok)

        def step(out, accepted):
            ctx = np.asarray(prompt + out, np.int64)
            r = RequestStep("a", np.asarray(out[len(out) - accepted:], np.int64), ctx,
                            len(prompt), 0, np.zeros(0, np.int64), None, None, 0.0,
                            params)
            return p.step(StepContext([r], max_draft=8)).tokens[0]

        out = [step(text[:1], 1)]
        if preempted:
            assert step(text[:1], 0) == []  # back in prefill: no drafts
        out.append(step(text[:2], 1))
        m = p.metrics()
        assert m["grammar_lost"] == 0 and m["num_errors"] == 0 and m["forced_tokens"] > 0
        return out

    assert drafts(preempted=True) == drafts(preempted=False)


def test_bridge_shows_a_resumed_request_in_prefill_and_not_finished():
    """build_context on a stand-in runner: the request back from preemption
    is in the batch with its whole context, no accepted tokens, and is not
    reported finished."""
    from vllm_plugins.bridge.state import RunnerState
    from vllm_plugins.bridge.v1.step import build_context

    ids = np.zeros((2, 16), np.int64)
    ids[0, :6] = PROMPT + [5, 6]
    ids[1, :4] = [9, 9, 9, 9]
    batch = SimpleNamespace(req_ids=["a", "b"], num_tokens_no_spec=np.array([6, 4]),
                            token_ids_cpu=ids, num_prompt_tokens=np.array([4, 3]),
                            vocab_size=16)
    params = SimpleNamespace(temperature=0.0, n=1)
    runner = SimpleNamespace(input_batch=batch, requests={
        "a": SimpleNamespace(sampling_params=params),
        "b": SimpleNamespace(sampling_params=params)})
    state = RunnerState(proposer=SimpleNamespace(max_draft=3, masked_topk_wanted=lambda: 0))
    sched = SimpleNamespace(finished_req_ids=set(), total_num_scheduled_tokens=7,
                            preempted_req_ids=set())
    ctx = build_context(runner, state, sched, [[], [9]])
    a = ctx.requests[0]
    assert a.in_prefill and a.num_draft == 0 and list(a.context) == PROMPT + [5, 6]
    assert a.num_prompt_tokens == 4 and not ctx.finished
