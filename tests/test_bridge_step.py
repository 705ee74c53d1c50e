"""The bridge's step, start-up refusals and runner state, without an engine."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_plugins.bridge import worker_rpc
from vllm_plugins.bridge.state import ATTR, RunnerState, attach, state_of
from vllm_plugins.bridge.v1 import runner as bridge_runner
from vllm_plugins.bridge.v1 import step


def stand_in_runner(proposer):
    """Two requests: 'a' verified drafts [7, 8] and emitted [7, 9]; 'b' is
    still in prefill. Token arrays as vLLM's bookkeeping leaves them."""
    tokens = np.zeros((2, 16), dtype=np.int64)
    tokens[0, :6] = [1, 2, 3, 4, 7, 9]  # prompt 1 2 3, output 4 | 7 9
    tokens[1, :3] = [5, 6, 5]
    batch = SimpleNamespace(
        req_ids=["a", "b"], num_tokens_no_spec=np.array([6, 3]),
        token_ids_cpu=tokens, num_prompt_tokens=np.array([3, 3]), vocab_size=50)
    params = SimpleNamespace(temperature=0.0, n=1)
    runner = SimpleNamespace(input_batch=batch, drafter=proposer, device="cpu",
                             requests={"a": SimpleNamespace(sampling_params=params),
                                       "b": SimpleNamespace(sampling_params=params)})
    return runner


def test_build_context_lines_up_verified_rows_with_the_targets_topk():
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    proposer = SimpleNamespace(topk_wanted=lambda: 3, max_draft=4,
                               masked_topk_wanted=lambda: 0)
    runner = stand_in_runner(proposer)
    state = attach(runner, proposer)
    logits = torch.randn(4, 50)  # a: 2 drafts + 1, b: 1
    metadata = SpecDecodeMetadata.make_dummy([[7, 8], []], torch.device("cpu"))
    step.stash_topk(state, logits, metadata)
    seconds = state.topk.seconds
    assert seconds > 0
    scheduler_output = SimpleNamespace(finished_req_ids={"gone"},
                                       total_num_scheduled_tokens=4)
    ctx = step.build_context(runner, state, scheduler_output, [[7, 9], []])
    a, b = ctx.requests
    assert a.req_id == "a" and list(a.accepted) == [7, 9]
    assert list(a.verified_tokens) == [4, 7, 8] and a.num_draft == 2
    want = torch.log_softmax(logits[:3], -1).topk(3)
    assert np.array_equal(a.topk_ids, want.indices.numpy())
    assert np.allclose(a.topk_logprobs, want.values.numpy(), atol=1e-5)
    assert b.in_prefill and b.topk_ids is None and b.num_draft == 0
    assert ctx.finished == {"gone"} and ctx.max_draft == 4
    assert ctx.last_topk_seconds == seconds
    assert state.topk is None  # consumed: a stale stash never reaches a later step


def test_a_stash_that_does_not_line_up_teaches_nothing():
    proposer = SimpleNamespace(topk_wanted=lambda: 2, max_draft=4,
                               masked_topk_wanted=lambda: 0)
    runner = stand_in_runner(proposer)
    state = attach(runner, proposer)
    step.stash_topk(state, torch.randn(3, 50), None)  # three rows, two requests
    ctx = step.build_context(runner, state, SimpleNamespace(
        finished_req_ids=set(), total_num_scheduled_tokens=2), [[9], []])
    assert all(r.topk_ids is None for r in ctx.requests)


def test_a_requests_speculation_is_parsed_once_and_freed_when_it_finishes(monkeypatch):
    from vllm_plugins.proposers.sources import request as speculation

    parsed = []
    real = speculation.parse_speculation

    def counting(params, max_draft):
        parsed.append(max_draft)
        return real(params, max_draft)

    monkeypatch.setattr(speculation, "parse_speculation", counting)
    proposer = SimpleNamespace(topk_wanted=lambda: 0, max_draft=4,
                               masked_topk_wanted=lambda: 0)
    runner = stand_in_runner(proposer)
    runner.requests["a"].sampling_params = SimpleNamespace(
        temperature=0.0, n=1, extra_args={"speculation": '{"max_draft": 2}'})
    runner.requests["b"].sampling_params = SimpleNamespace(
        temperature=0.0, n=1, extra_args={"speculation": {"max_draft": 9}})
    state = attach(runner, proposer)

    def context(finished=()):
        return step.build_context(runner, state, SimpleNamespace(
            finished_req_ids=set(finished), total_num_scheduled_tokens=2), [[9], []])

    for _ in range(3):
        a, b = context().requests
        assert a.speculation.max_draft == 2 and a.speculation.problem is None
        # one the front end should have refused: no drafts, and why
        assert b.speculation.max_draft == 0 and "[0, 4]" in b.speculation.problem
    assert parsed == [4, 4]  # once per request, not per step
    context(finished={"a"})
    assert parsed == [4, 4, 4] and set(state.speculation) == {"a", "b"}  # a: a new request
    runner.input_batch.req_ids = ["b", "c"]
    context(finished={"a"})
    assert "a" not in state.speculation


@pytest.mark.parametrize("k", [0, 4])
def test_topk_extraction_is_timed_for_the_controller(k):
    """Work a resting step skips is timed apart and reaches the next context."""
    state = RunnerState(proposer=SimpleNamespace(topk_wanted=lambda: k))
    step.stash_topk(state, torch.randn(3, 50), None)
    assert (state.topk.seconds > 0.0) == (k > 0)
    assert (state.topk.ids is None) == (k == 0)


def test_finish_notices_survive_steps_that_schedule_nothing():
    """execute_model returns before drafting when nothing is scheduled; the
    finished ids of that step must still reach the proposer next step."""
    def vllm_execute(self, scheduler_output):
        return None

    execute = bridge_runner.wrap_execute_model(vllm_execute)
    runner = SimpleNamespace()
    state = attach(runner, proposer=object())
    execute(runner, SimpleNamespace(finished_req_ids={"a", "b"}))
    assert state.step_start is not None
    assert step.take_finished(state, SimpleNamespace(finished_req_ids={"c"})) == {
        "a", "b", "c"}
    assert step.take_finished(state, SimpleNamespace(finished_req_ids=set())) == set()


def test_runners_without_our_proposer_carry_nothing_of_ours():
    """Plain and vLLM-drafter runners go straight to vLLM's code: no state,
    no counters, no held request ids, however many steps run."""
    calls = []

    def vllm_execute(self, scheduler_output):
        calls.append("execute")

    def vllm_sample(self, logits, spec_decode_metadata):
        calls.append("sample")

    def vllm_propose(self, *args, **kwargs):
        calls.append("propose")
        return [[1]]

    def vllm_after_load(self):
        calls.append("load")

    execute = bridge_runner.wrap_execute_model(vllm_execute)
    sample = bridge_runner.wrap_sample(vllm_sample)
    propose = bridge_runner.wrap_propose(vllm_propose)
    after_load = bridge_runner.wrap_after_load(vllm_after_load)
    for drafter in (None, SimpleNamespace(propose=lambda *a: [[1]])):
        runner = SimpleNamespace(drafter=drafter)
        after_load(runner)
        for i in range(300):
            execute(runner, SimpleNamespace(finished_req_ids={f"r{i}"}))
            sample(runner, torch.zeros(1, 4), None)
            assert propose(runner, None, [[1]], None, None, None, None, None) == [[1]]
        assert state_of(runner) is None and ATTR not in vars(runner)
        assert set(vars(runner)) == {"drafter"}
    assert calls.count("execute") == 600 and calls.count("load") == 2


def test_counting_is_opt_in_for_vllms_own_drafters():
    def vllm_propose(self, *args, **kwargs):
        return [[1, 2]]

    propose = bridge_runner.wrap_propose(vllm_propose)
    worker = SimpleNamespace(model_runner=SimpleNamespace())
    read = worker_rpc.add_read_stats(None)
    assert read(worker) == {}
    worker_rpc.add_count_steps(None)(worker)
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    md = SpecDecodeMetadata.make_dummy([[4, 5]], torch.device("cpu"))
    propose(worker.model_runner, None, [[4, 6]], None, None, None, None, md)
    assert read(worker) == {"steps": 1, "drafted": 2, "accepted": 1, "tokens": 2,
                            "tree_steps": 0, "tree_only_steps": 0, "tree_requests": 0,
                            "kv_moved": 0, "malformed_drafts": 0, "rank_disagreements": 0}


# ------------------------------------------------------------- start-up
def spec_config(method, **extra):
    from vllm_plugins.registry import METHODS, PLUGIN_OPTIONS_ATTR

    return SimpleNamespace(**{PLUGIN_OPTIONS_ATTR: {"method": method, **extra},
                              "model": METHODS[method].class_path,
                              "num_speculative_tokens": 5,
                              "rejection_sample_method": "standard"})


def test_plugin_lookahead_only_for_self_drafting_methods():
    from vllm_plugins.bridge.config import plugin_lookahead

    assert plugin_lookahead(spec_config("swift")) == 5
    assert plugin_lookahead(spec_config("del")) == 5
    assert plugin_lookahead(spec_config("token_recycling")) == 0
    grammar = "grammar_forced"
    assert plugin_lookahead(spec_config(grammar, inner={"method": "swift"})) == 5
    assert plugin_lookahead(spec_config(grammar, inner="token_recycling")) == 0
    assert plugin_lookahead(SimpleNamespace(model="x.Y", num_speculative_tokens=3)) == 0


def test_unsafe_combinations_are_refused_at_start_up():
    from vllm_plugins.bridge.config import refuse_unsafe

    one = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                          data_parallel_size=1)
    refuse_unsafe("token_recycling", spec_config("token_recycling"), one)
    for method in ("token_recycling", "stand", "swift", "del"):
        refuse_unsafe(method, spec_config(method),
                      SimpleNamespace(**{**vars(one), "tensor_parallel_size": 2}))
    with pytest.raises(ValueError, match="pipeline_parallel_size=2"):
        refuse_unsafe("stand", spec_config("stand"),
                      SimpleNamespace(**{**vars(one), "pipeline_parallel_size": 2}))
    # Data parallel: served by methods that draft from tokens and logits,
    # refused by those that run the target's layers to draft.
    data_parallel = SimpleNamespace(**{**vars(one), "data_parallel_size": 2})
    for method, extra in (("token_recycling", {}), ("stand", {}), ("hybrid", {}),
                          ("ngram_adaptive", {}),
                          ("grammar_forced", {"inner": "token_recycling"})):
        refuse_unsafe(method, spec_config(method, **extra), data_parallel)
    for method, extra in (("swift", {}), ("del", {}),
                          ("grammar_forced", {"inner": {"method": "del"}})):
        with pytest.raises(ValueError, match="data_parallel_size=2: a self-drafting"):
            refuse_unsafe(method, spec_config(method, **extra), data_parallel)
    lossy = spec_config("token_recycling")
    lossy.rejection_sample_method = "fly"
    with pytest.raises(ValueError, match="rejection_sample_method 'fly'"):
        refuse_unsafe("token_recycling", lossy, one)


def test_self_drafting_refuses_targets_with_several_attention_kinds():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from vllm_plugins.bridge.v1.target_layers import check_target

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8,
                             dtype=torch.float32)
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=8,
                               dtype=torch.float32, sliding_window=64)
    runner = SimpleNamespace(get_model=lambda: torch.nn.Identity(),
                             get_kv_cache_spec=lambda: {"l0": full, "l1": full})
    check_target(runner, "swift")
    runner.get_kv_cache_spec = lambda: {"l0": full, "l1": window}
    with pytest.raises(ValueError, match="'swift'.*2 kinds.*SlidingWindowSpec"):
        check_target(runner, "swift")


def test_draft_probabilities_reach_vllm_as_the_dense_rows_it_verifies():
    """vLLM's own _get_spec_decode_draft_probs, run over our lazy rows, gives
    exactly the dense rows: the proposer's for stochastic drafts, one-hot for
    deterministic ones, cut where the scheduler cut a draft."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    vocab = 7
    rng = np.random.default_rng(0)
    p_b = rng.dirichlet(np.ones(vocab), size=3).astype(np.float32)
    runner = SimpleNamespace(device="cpu", input_batch=SimpleNamespace(
        req_ids=["a", "b", "c"], vocab_size=vocab))
    drafts = step.Drafts(tokens=[[1, 2], [3, 4, 5], []], probs=[None, p_b, None])
    step.set_draft_probs(runner, drafts, drafts.tokens)
    # Next step: 'c' left, 'b' comes first and its draft was cut to 2 tokens.
    runner.input_batch = SimpleNamespace(req_ids=["b", "a"], vocab_size=vocab)
    metadata = SpecDecodeMetadata.make_dummy([[3, 4], [1, 2]], torch.device("cpu"))
    got = GPUModelRunner._get_spec_decode_draft_probs(runner, metadata)
    want = torch.zeros(4, vocab)
    want[:2] = torch.from_numpy(p_b[:2])
    want[2, 1] = want[3, 2] = 1.0
    assert torch.equal(got, want)
    # Nothing stochastic drafted: vLLM keeps its deterministic path.
    fresh = SimpleNamespace(device="cpu", input_batch=runner.input_batch)
    step.set_draft_probs(fresh, step.Drafts([[1], [2]], [None, None]), [[1], [2]])
    assert not hasattr(fresh, "_draft_probs")
