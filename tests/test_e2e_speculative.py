"""Lossless end to end: our proposers inside vllm.LLM give vLLM's own tokens."""

import pytest

from tests.attention_routes import tree_routes
from tests.conftest import shutdown

# One worker runs this module and tests/test_layer_skip_e2e.py, which runs
# these tests too (tests/conftest.py, MODULE_GROUPS): the plain references
# (_BASE) are computed once for both.
pytestmark = pytest.mark.slow

N_PROMPTS = 12  # two per category of the first six Spec-Bench categories
MAX_TOKENS = 64
_BASE: dict = {}


def engine(model_path, spec):
    from vllm_plugins.bench.engines import build_engine

    return build_engine(model_path, spec, max_num_seqs=8, max_model_len=1024)


@pytest.fixture(scope="module")
def prompts(base):
    from vllm_plugins.bench.data import load_questions, render

    qs = load_questions(per_category=2)[:N_PROMPTS]
    tok = base.get_tokenizer()
    return [render(tok, q) for q in qs]


@pytest.fixture(scope="module", params=[
    {"method": "token_recycling", "num_speculative_tokens": 6},
    {"method": "ngram_adaptive", "num_speculative_tokens": 5,
     "draft_length": "goodput"},
], ids=["token_recycling", "ngram_adaptive-goodput"])
def spec(request, model_path):
    llm = engine(model_path, request.param)
    # The default configuration gets all N_PROMPTS prompts; variants fewer.
    llm.n_prompts = N_PROMPTS if request.param_index == 0 else 6
    llm.goodput = True  # token_recycling's default and the explicit variant
    yield llm
    shutdown(llm)


def greedy(max_tokens=MAX_TOKENS, **kw):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def test_batch1_greedy_identical(base, spec, prompts):
    from vllm_plugins.bench.engines import engine_stats, run_batch

    # The reference is computed once for all variants, the prompts in one
    # batch: plain greedy decoding gives each prompt the tokens it gets alone
    # (the comparison below relies on that for the speculative engine's
    # verification rows too), several times faster than one by one.
    missing = [p for p in prompts[:spec.n_prompts] if tuple(p) not in _BASE]
    if missing:
        for p, ref in zip(missing, run_batch(base, missing, greedy())[0]):
            _BASE[tuple(p)] = ref.token_ids
    for p in prompts[:spec.n_prompts]:
        key = tuple(p)
        # Greedy: a shorter run must be a prefix of the reference.
        n = getattr(spec, "max_tokens", MAX_TOKENS)
        got, _ = run_batch(spec, [p], greedy(n))
        assert got[0].token_ids == _BASE[key][:n]
    stats = engine_stats(spec)
    assert stats["drafted"] > 0 and stats["accepted"] > 0, stats
    # A chain method's engine keeps vLLM's attention and runner methods: no
    # tree route per layer or per step.
    routes = spec.collective_rpc(tree_routes)[0]
    assert routes["layers"] > 0 and routes["routed_layers"] == 0 and routes["runner"] == []
    if getattr(spec, "goodput", False):
        # Our own work per awake step (the bridge's top-k, the proposer) is
        # timed apart from the engine's step ...
        dl = stats["proposer"]["draft_length"]
        assert any(awake and awake > 0
                   for _, awake in dl["own_ms_per_step"].values()), dl
        # ... and so is the engine's time around the runner, which every step pays.
        assert dl["engine_gap_ms"] and dl["engine_gap_ms"] > 0, dl
    else:  # fixed length (the layer-skip module's fixtures): no controller
        assert "draft_length" not in stats["proposer"], stats["proposer"]
    assert stats["proposer"]["num_errors"] == 0


def test_batch8_mixed_lengths_with_abort_identical(base, spec, prompts):
    from vllm_plugins.bench.engines import run_batch

    batch = prompts[:8]
    lengths = [16, 64, 32, 48, 8, 64, 24, 40]
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    outs = {}
    for name, llm in (("base", base), ("spec", spec)):
        engine = llm.llm_engine
        ids = [f"{name}-{i}" for i in range(8)]
        toks = {r: [] for r in ids}
        for r, p, n in zip(ids, batch, lengths):
            sp = SamplingParams(temperature=0.0, max_tokens=n,
                                output_kind=RequestOutputKind.DELTA)
            engine.add_request(r, {"prompt_token_ids": p}, sp)
        step = 0
        while engine.has_unfinished_requests():
            for o in engine.step():
                toks[o.request_id].extend(o.outputs[0].token_ids)
            step += 1
            if step == 6:
                engine.abort_request([ids[3]])
        outs[name] = [toks[r] for r in ids]
    for i in range(8):
        if i == 3:  # aborted in both engines after 6 steps: a common prefix
            a, b = outs["base"][3], outs["spec"][3]
            n = min(len(a), len(b))
            assert n > 0 and a[:n] == b[:n]
            assert max(len(a), len(b)) < lengths[3]
        else:
            assert outs["spec"][i] == outs["base"][i], i
            assert len(outs["spec"][i]) == lengths[i]
    # The engine keeps serving after the abort.
    again, _ = run_batch(spec, [batch[3]], greedy(16))
    want, _ = run_batch(base, [batch[3]], greedy(16))
    assert again[0].token_ids == want[0].token_ids


def test_sampled_run_completes_with_seed(spec, prompts):
    from vllm import SamplingParams

    from vllm_plugins.bench.engines import run_batch

    sp = SamplingParams(temperature=1.0, max_tokens=32, seed=1234, ignore_eos=True)
    first, _ = run_batch(spec, prompts[:4], sp)
    assert all(len(r.token_ids) == 32 for r in first)


def test_bad_option_fails_before_the_model_loads(model_path):
    from vllm import LLM

    with pytest.raises(ValueError, match="min_confidence"):
        LLM(model=model_path, speculative_config={
            "method": "token_recycling", "min_confidence": 7})


def test_grammar_request_decodes_as_without_speculation(base, spec, prompts):
    """vLLM's V1 runner runs no custom logits processor with speculation; on
    an engine drafting with one of ours the bridge applies the grammar at
    every verified position, so a grammar request gets the tokens it gets
    on a plain engine, and they match the grammar."""
    import re

    from vllm_plugins.bench.engines import run_batch

    pattern = "[0-9]{3}-[a-z]{4}"
    params = greedy(16, extra_args={"grammar": {"regex": pattern}})
    want = run_batch(base, [prompts[0]], params)[0][0].token_ids
    got = run_batch(spec, [prompts[0]], params)[0][0].token_ids
    text = base.get_tokenizer().decode(want, skip_special_tokens=True)
    assert re.fullmatch(pattern, text), text
    assert got == want


def test_server_with_speculative_config_matches_plain_decoding(base, prompts,
                                                               model_path, tmp_path):
    """`--speculative-config '{"method": "token_recycling", ...}'` on the
    OpenAI server: the same greedy tokens as plain decoding."""
    import json

    from vllm_plugins.bench.engines import run_batch
    from tests.serving import post, running_server

    spec = json.dumps({"method": "token_recycling", "num_speculative_tokens": 6})
    with running_server(model_path, ["--speculative-config", spec],
                        tmp_path / "server.log") as url:
        wants = [r.token_ids for r in run_batch(base, prompts[:3], greedy(32))[0]]
        for p, want in zip(prompts[:3], wants):
            status, body = post(url + "/v1/completions", {
                "model": model_path, "prompt": p, "max_tokens": 32,
                "temperature": 0, "return_token_ids": True})
            assert status == 200, body
            assert body["choices"][0]["token_ids"] == want
        # Our grammar processor runs under speculation on this server.
        pattern = "[0-9]{3}-[a-z]{4}"
        want = run_batch(base, [prompts[0]], greedy(
            16, extra_args={"grammar": {"regex": pattern}}))[0][0].token_ids
        status, body = post(url + "/v1/completions", {
            "model": model_path, "prompt": prompts[0], "max_tokens": 16,
            "temperature": 0, "return_token_ids": True,
            "vllm_xargs": {"grammar": json.dumps({"regex": pattern})}})
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == want


def test_device_tables_give_plain_decodings_tokens(base, prompts, model_path):
    """``"tables": "device"`` (CPU tensors here) drafts on V1 from the same
    code the V2 route runs: six prompts at once, then two again in the slots
    the first six freed, with the same greedy tokens as plain decoding."""
    from vllm_plugins.bench.engines import engine_stats, run_batch

    batch = prompts[:6]
    want = [r.token_ids for r in run_batch(base, batch, greedy(40))[0]]
    llm = engine(model_path, {"method": "token_recycling", "num_speculative_tokens": 6,
                              "draft_length": "fixed", "tables": "device"})
    try:
        got = [r.token_ids for r in run_batch(llm, batch, greedy(40))[0]]
        assert got == want
        again = run_batch(llm, batch[:2], greedy(20))[0]
        assert [r.token_ids for r in again] == [w[:20] for w in want[:2]]
        stats = engine_stats(llm)
        assert stats["accepted"] > 0 and stats["proposer"]["num_errors"] == 0, stats
    finally:
        shutdown(llm)
