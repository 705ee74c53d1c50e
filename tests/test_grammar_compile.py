"""Grammar compilation off the engine loop, and grammar errors that end a request.

No engine is started: a real vLLM ``Scheduler`` (with a small KV cache) is
driven by hand with our patches applied, and the grammar processor is driven
as vLLM's V1 input batch drives it.
"""

from __future__ import annotations

import gc
import json
import pickle
import threading
import time

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("llguidance")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from tests.processor_fixtures import processor_fixtures  # noqa: E402
from vllm_plugins.bench.grammar_compile_ttft import large_schema  # noqa: E402
from vllm_plugins.grammar.compile_cache import OnceCache, compile_pool, compile_request  # noqa: E402

vllm_config, tokenizer = processor_fixtures("model_path", max_model_len=1024)


def _salt() -> str:
    return f"t{time.monotonic_ns()}_"


# ---------------------------------------------------------------- the caches
def test_once_cache_computes_a_key_once_for_all_threads():
    cache = OnceCache(4)
    calls = []

    def make():
        calls.append(1)
        time.sleep(0.2)
        return object()

    got = []
    threads = [threading.Thread(target=lambda: got.append(cache.get("k", make)))
               for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(got) == 6 and all(g is got[0] for g in got)


def test_once_cache_forgets_failures_and_stays_bounded():
    cache = OnceCache(2)
    with pytest.raises(ZeroDivisionError):
        cache.get("bad", lambda: 1 / 0)
    assert cache.get("bad", lambda: 7) == 7  # tried again, not the kept error
    for key in "abc":
        cache.get(key, lambda: key)
    assert len(cache) == 2 and cache.peek("a") is None and cache.peek("c") is not None


@pytest.fixture(scope="module")
def runtime(vllm_config):
    from vllm_plugins.grammar.runtime import engine_runtime

    return engine_runtime(vllm_config.model_config)


def test_a_spec_is_compiled_once_and_the_worker_finds_it(runtime):
    from vllm_plugins.grammar.spec import compile_grammar_request

    raw = {"json_schema": large_schema(40, salt=_salt())}
    first = compile_request(raw, lambda: runtime)
    template = first.result(timeout=120)
    again = compile_request(json.loads(json.dumps(raw)), lambda: runtime)
    assert again.done() and again.result() is template
    # What the grammar processor does in the worker: the same template.
    assert runtime.template(compile_grammar_request(raw)) is template


def _max_gap_while(fut_or_thread_alive) -> float:
    """The longest time this thread went without running Python, while the
    other thread works."""
    gaps = []
    last = time.perf_counter()
    while fut_or_thread_alive():
        sum(range(200))
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    return max(gaps)


def test_llguidance_compiles_without_holding_the_gil(runtime):
    """A compile on the pool leaves the engine thread running Python: its
    longest pause is a small part of the compile. The control, a C loop that
    holds the GIL for as long, pauses it for about its whole duration, so
    the measurement can tell the two apart. The heap is frozen first, as
    vLLM's engine core freezes its own after start-up: else the compile's
    allocations may set off a full collection of this test process's heap,
    a pause as long as the compile's that is not the compile's."""
    raw = {"json_schema": large_schema(400, salt=_salt())}
    gc.collect()
    gc.freeze()
    try:
        start = time.perf_counter()
        fut = compile_request(raw, lambda: runtime)
        gap = _max_gap_while(lambda: not fut.done())
        took = time.perf_counter() - start
    finally:
        gc.unfreeze()
    fut.result()
    assert took > 0.3, took  # a compile long enough to see a stall in
    assert gap < 0.35 * took, (gap, took)

    def hold_gil():
        sum(range(int(1.5e7)))  # one C call: the GIL is not released

    start = time.perf_counter()
    control = compile_pool().submit(hold_gil)
    control_gap = _max_gap_while(lambda: not control.done())
    control_took = time.perf_counter() - start
    assert control_gap > 0.5 * control_took, (control_gap, control_took)


# ---------------------------------------------------------- a real scheduler
@pytest.fixture(scope="module")
def make_scheduler(vllm_config):
    import vllm_plugins
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,
                                            KVCacheGroupSpec)
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_plugins.register()
    vllm_config.cache_config.num_gpu_blocks = 64
    block = vllm_config.cache_config.block_size
    spec = FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=8,
                             dtype=torch.float32)

    def make():
        kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
        return Scheduler(vllm_config, kv, StructuredOutputManager(vllm_config),
                         block_size=block)

    return make


def request(req_id: str, grammar=None, max_tokens: int = 8) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0,
                        extra_args=None if grammar is None else {"grammar": grammar})
    sp.update_from_generation_config({}, 2)
    return Request(req_id, [5, 6, 7], sp, None)


def _runner_output(scheduler_output, tokens: dict[str, list[int]]):
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[tokens.get(r, [9]) for r in ids])


def _outputs(engine_outputs) -> dict:
    return {o.request_id: o for outs in engine_outputs.values() for o in outs.outputs}


def test_scheduler_holds_a_grammar_request_until_it_is_compiled(make_scheduler):
    from vllm_plugins.bridge.grammar_hold import PENDING_ATTR

    sched = make_scheduler()
    held = request("held", {"json_schema": large_schema(300, salt=_salt())})
    sched.add_request(held)
    sched.add_request(request("plain"))
    assert held.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"plain"}  # the other is not stalled
    sched.update_from_output(out, _runner_output(out, {}))
    getattr(held, PENDING_ATTR).result(timeout=120)
    out = sched.schedule()
    assert "held" in out.num_scheduled_tokens and held.status == RequestStatus.RUNNING


def test_compiled_grammars_and_plain_requests_are_not_held(make_scheduler, runtime):
    raw = {"regex": "(ab)+"}
    compile_request(raw, lambda: runtime).result(timeout=60)
    sched = make_scheduler()
    ready, plain = request("ready", raw), request("plain")
    sched.add_request(ready)
    sched.add_request(plain)
    assert ready.status == plain.status == RequestStatus.WAITING
    assert set(sched.schedule().num_scheduled_tokens) == {"ready", "plain"}


def test_a_grammar_that_does_not_compile_in_the_engine_ends_with_an_error(make_scheduler):
    from vllm.v1.engine import FinishReason

    sched = make_scheduler()
    bad = request("bad", {"regex": "a(b"})  # the front end would refuse it
    sched.add_request(bad)
    sched.add_request(request("plain"))
    for _ in range(200):
        out = sched.schedule()
        assert "bad" not in out.num_scheduled_tokens
        got = _outputs(sched.update_from_output(out, _runner_output(out, {})))
        if "bad" in got:
            break
        time.sleep(0.01)
    assert got["bad"].finish_reason == FinishReason.ERROR
    assert bad.status == RequestStatus.FINISHED_ERROR


def _running(sched, *reqs):
    for r in reqs:
        sched.add_request(r)
    for _ in range(200):
        out = sched.schedule()
        if all(r.status == RequestStatus.RUNNING for r in reqs):
            return out
        sched.update_from_output(out, _runner_output(out, {}))
        time.sleep(0.01)
    raise AssertionError("requests never ran")


@pytest.mark.parametrize("reported", [True, False], ids=["reported", "control"])
def test_a_matcher_error_ends_the_request_with_an_error(make_scheduler, reported):
    """The worker's report on the step's output finishes the request with
    FINISHED_ERROR, and the token sampled after the error is not output;
    the other request goes on. Without the report it would run on."""
    from vllm.v1.engine import FinishReason

    from vllm_plugins.bridge.grammar_hold import ERRORS_ATTR

    sched = make_scheduler()
    g, p = request("g", {"regex": "(ab)+"}), request("p")
    out = _running(sched, g, p)
    mro = _runner_output(out, {"g": [77], "p": [9]})
    if reported:
        setattr(mro, ERRORS_ATTR, {"g": "token rejected by the grammar"})
    got = _outputs(sched.update_from_output(out, mro))
    assert got["p"].new_token_ids == [9] and p.status == RequestStatus.RUNNING
    if reported:
        assert got["g"].finish_reason == FinishReason.ERROR and not got["g"].new_token_ids
        assert g.status == RequestStatus.FINISHED_ERROR and 77 not in g.output_token_ids
    else:
        assert got["g"].finish_reason is None and got["g"].new_token_ids == [77]
        assert g.status == RequestStatus.RUNNING


# ---------------------------------------------------- the worker's report
@pytest.fixture(scope="module")
def tokenizer_ids(tokenizer):
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_processor_reports_a_matcher_error_once_by_batch_index(
        vllm_config, tokenizer_ids):
    from vllm.v1.sample.logits_processor import BatchUpdate
    from vllm.v1.sample.logits_processor.state import LogitsProcessors

    from vllm_plugins.bridge.grammar_weights import take_reports
    from vllm_plugins.logits_processors.grammar import GrammarLogitsProcessor

    proc = GrammarLogitsProcessor(vllm_config, torch.device("cpu"), False)
    vocab = vllm_config.model_config.get_vocab_size()
    good, bad = [], []
    sp = request("x", {"regex": "(ab)+"}).sampling_params
    proc.update_state(BatchUpdate(2, [], [(0, sp, [1], good), (1, sp, [1], bad)], []))
    proc.apply(torch.zeros(2, vocab))
    assert proc.take_failures() == {}
    good.extend(tokenizer_ids("ab"))
    bad.extend(tokenizer_ids("xyz"))  # e.g. a later processor overrode the mask
    proc.apply(torch.zeros(2, vocab))
    batch = type("Batch", (), {})()
    batch.logitsprocs = LogitsProcessors([proc])
    batch.req_ids = ["req-good", "req-bad"]
    errors = take_reports(batch)[0]
    assert list(errors) == ["req-bad"] and errors["req-bad"]
    proc.apply(torch.zeros(2, vocab))
    assert take_reports(batch)[0] == {}  # reported once


def test_the_worker_hook_puts_the_steps_matcher_errors_on_its_output(
        vllm_config, tokenizer_ids):
    from types import SimpleNamespace

    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.sample.logits_processor import BatchUpdate
    from vllm.v1.sample.logits_processor.state import LogitsProcessors

    from vllm_plugins.bridge.grammar_hold import ERRORS_ATTR
    from vllm_plugins.bridge.worker_report import wrap_worker_sample_tokens
    from vllm_plugins.logits_processors.grammar import GrammarLogitsProcessor

    proc = GrammarLogitsProcessor(vllm_config, torch.device("cpu"), False)
    vocab = vllm_config.model_config.get_vocab_size()
    bad = []
    sp = request("x", {"regex": "(ab)+"}).sampling_params
    proc.update_state(BatchUpdate(2, [], [(1, sp, [1], bad)], []))
    batch = SimpleNamespace(logitsprocs=LogitsProcessors([proc]), req_ids=[None, "req-bad"])
    worker = SimpleNamespace(model_runner=SimpleNamespace(input_batch=batch))
    sample_tokens = wrap_worker_sample_tokens(lambda w, grammar_output: ModelRunnerOutput(
        req_ids=["req-bad"], req_id_to_index={"req-bad": 0}))
    proc.apply(torch.zeros(2, vocab))
    assert not hasattr(sample_tokens(worker, None), ERRORS_ATTR)
    bad.extend(tokenizer_ids("xyz"))
    proc.apply(torch.zeros(2, vocab))
    errors = getattr(sample_tokens(worker, None), ERRORS_ATTR)
    assert list(errors) == ["req-bad"] and errors["req-bad"]
    proc.apply(torch.zeros(2, vocab))
    assert not hasattr(sample_tokens(worker, None), ERRORS_ATTR)   # reported once


def test_the_report_rides_the_runner_output_to_another_process():
    """Under a multiprocess executor the output rank's ModelRunnerOutput is
    pickled to the engine core: our attribute goes with it."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    from vllm_plugins.bridge.grammar_hold import ERRORS_ATTR, attach_to_output
    from vllm_plugins.bridge.grammar_weights import WEIGHTS_ATTR

    out = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0},
                            sampled_token_ids=[[3]])
    attach_to_output(out, {ERRORS_ATTR: {"a": "why"}, WEIGHTS_ATTR: {"a": [-0.5]}})
    back = pickle.loads(pickle.dumps(out))
    assert getattr(back, ERRORS_ATTR) == {"a": "why"}
    assert getattr(back, WEIGHTS_ATTR) == {"a": [-0.5]}
    attach_to_output(EMPTY_MODEL_RUNNER_OUTPUT, {ERRORS_ATTR: {"a": "why"}})
    assert not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, ERRORS_ATTR)

    class Async:
        def get_output(self):
            return ModelRunnerOutput(req_ids=["b"], req_id_to_index={"b": 0})

    later = Async()
    attach_to_output(later, {ERRORS_ATTR: {"b": "why"}, WEIGHTS_ATTR: {}})
    assert getattr(later.get_output(), ERRORS_ATTR) == {"b": "why"}
    assert not hasattr(later.get_output(), WEIGHTS_ATTR)


# ------------------------------------------------------ deep $ref chains
_REF_CHAIN = (
    "import json\n"
    "defs = {f'D{i}': {'$ref': f'#/$defs/D{i + 1}'} for i in range(3000)}\n"
    "defs['D3000'] = {'type': 'integer'}\n"
    "schema = json.dumps({'$defs': defs, '$ref': '#/$defs/D0'})\n"
)


def _run_python(code: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)


def test_a_long_ref_chain_neither_crashes_the_front_end_nor_the_engine(model_path):
    """llguidance recurses through $ref chains on the calling thread's stack:
    called directly on the main thread it kills the process (the control);
    through our compile path (validation and matcher) it does not."""
    control = _run_python(_REF_CHAIN + (
        "import llguidance\n"
        "grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)\n"
        "llguidance.LLMatcher.validate_grammar_with_warnings(grammar)\n"))
    assert control.returncode < 0, control  # killed by a signal (stack overflow)
    ours = _run_python(_REF_CHAIN + (
        "from transformers import AutoTokenizer\n"
        "from vllm_plugins.grammar.runtime import runtime_for\n"
        "from vllm_plugins.grammar.spec import compile_grammar_request\n"
        f"tok = AutoTokenizer.from_pretrained({str(model_path)!r})\n"
        "rt = runtime_for(tok, None, ('chain',))\n"
        "m = rt.new_matcher(compile_grammar_request({'json_schema': schema}))\n"
        "print('matcher', repr(m.get_error()))\n"))
    assert ours.returncode == 0 and "matcher ''" in ours.stdout, ours


def test_grammar_forced_engines_also_wait_for_the_drafts_matcher(model_path):
    """With grammar_forced drafts, a vLLM structured-output request is
    released only once the proposer's llguidance matcher is compiled too, so
    the proposer finds it instead of compiling it inside a step."""
    import vllm_plugins
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,
                                            KVCacheGroupSpec)
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_plugins.grammar.runtime import engine_runtime
    from vllm_plugins.grammar.structured_outputs import grammar_for

    vllm_plugins.register()
    cfg = EngineArgs(model=model_path, max_model_len=1024, enforce_eager=True,
                     dtype="float32", speculative_config={
                         "method": "grammar_forced", "num_speculative_tokens": 3},
                     ).create_engine_config()
    cfg.cache_config.num_gpu_blocks = 64
    block = cfg.cache_config.block_size
    spec = FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=8,
                             dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    sched = Scheduler(cfg, kv, StructuredOutputManager(cfg), block_size=block)
    so = StructuredOutputsParams(json=large_schema(200, salt=_salt()))
    so._backend = "guidance"  # what the front end sets
    sp = SamplingParams(max_tokens=4, structured_outputs=so)
    sp.update_from_generation_config({}, 2)
    req = Request("so", [5, 6, 7], sp, None)
    sched.structured_output_manager.grammar_init(req)  # what the engine core does
    sched.add_request(req)
    for _ in range(1000):
        if "so" in sched.schedule().num_scheduled_tokens:
            break
        time.sleep(0.01)
    assert req.status == RequestStatus.RUNNING
    ours = engine_runtime(cfg.model_config)._templates.peek(
        grammar_for(so, cfg.structured_outputs_config).grammar)
    assert ours is not None and ours.done() and ours.exception() is None


def test_held_specs_go_to_the_workers_once_and_start_their_compile(
        make_scheduler, vllm_config):
    """Worker processes have caches of their own: the step after a hold
    names the held spec on its SchedulerOutput (which pickles to them), and
    a worker starts compiling it at once."""
    from types import SimpleNamespace

    from vllm_plugins.bridge.grammar_hold import PRECOMPILE_ATTR, wrap_worker_execute_model
    from vllm_plugins.grammar import compile_cache

    sched = make_scheduler()
    raw = {"json_schema": large_schema(100, salt=_salt())}
    sched.add_request(request("held", raw))
    out = sched.schedule()
    assert getattr(out, PRECOMPILE_ATTR) == [raw]
    assert not hasattr(sched.schedule(), PRECOMPILE_ATTR)  # sent once
    sent = pickle.loads(pickle.dumps(out))
    # A worker process: the spec's compile is started before the step runs.
    compile_cache._REQUESTS._after_fork()  # as a fresh process would see it
    key = compile_cache.spec_text(raw)
    with compile_cache._REQUESTS._lock:
        compile_cache._REQUESTS._items.pop(key, None)
    seen = []
    worker = SimpleNamespace(vllm_config=vllm_config)
    wrap_worker_execute_model(lambda self, so: seen.append(so))(worker, sent)
    assert seen == [sent] and compile_cache._REQUESTS.peek(key) is not None
    compile_cache._REQUESTS.peek(key).result(timeout=120)
