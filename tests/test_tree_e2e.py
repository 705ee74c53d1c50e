"""Tree drafts verified inside vLLM's engine: greedy output token for token
that of plain decoding.

The proposer here (``OracleTreeProposer``, registered for this module only)
knows plain decoding's output (written by the reference engine to a file
named by an environment variable) and builds trees whose accepted path never
sits at the node indices a chain would use: every level has a wrong sibling
before the right node, and the right branch turns wrong at a depth drawn per
step. So every accepted node's K/V must move, positions must be by depth and
attention by ancestry, or the output departs from plain decoding's. Odd
prompts get chains, so each batch mixes both; one request asks for logprobs,
which the tree path does not serve (it gets its chain prefix); a second wave
of prompts extends the first prompts by part of their output, and prefix
caching (vLLM's default) serves it from blocks the tree steps filled
(blocks of 32 tokens, so the first block of each second-wave prompt holds
generated tokens; the outputs' ``num_cached_tokens`` show the hits).

The same engine then samples a seeded request (drafted a fixed-shape tree
of its own every step) alone, beside a prefill and beside chain requests:
its tokens must not depend on what shares its steps.
"""

import json
import os

import numpy as np
import pytest

from tests.attention_routes import tree_routes
from tests.conftest import shutdown
from vllm_plugins.proposers.base import PluginProposer
from vllm_plugins.step_context import Drafts

pytestmark = pytest.mark.slow

ORACLE_ENV = "VLLM_PLUGINS_TEST_TREE_ORACLE"
MAX_TOKENS = 48
NODES = 8
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
    "red blue green red blue green red blue green red blue",
]
EXTEND = 24  # output tokens the second wave's prompts carry
BLOCK_SIZE = 32  # the CPU backend's smallest: a second-wave prompt fills one
SEEDED_PROMPT = "Once upon a time, in a land far away, there lived a"
SEEDED_TREE = [-1, -1, 0, 0, 1, 2, 3, 4]  # NODES nodes, two root children
SEEDED_TOKENS = 24


class OracleTreeProposer(PluginProposer):
    """Test-only: trees around the reference continuation (see module doc)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        with open(os.environ[ORACLE_ENV]) as f:
            data = json.load(f)
        self.refs = [np.asarray(s, dtype=np.int64) for s in data["sequences"]]
        self.chain_prompts = {tuple(p) for p in data["chain_prompts"]}
        self.seeded_prompts = {tuple(p) for p in data.get("seeded_prompts", ())}

    def draft(self, ctx):
        tokens, parents = [[] for _ in ctx.requests], [None for _ in ctx.requests]
        for i, r, budget in self.drafting_requests(ctx):
            ctx_tokens = np.asarray(r.context, dtype=np.int64)
            ref = next((s for s in self.refs if len(s) > len(ctx_tokens)
                        and np.array_equal(s[:len(ctx_tokens)], ctx_tokens)), None)
            prompt = tuple(int(t) for t in ctx_tokens[:r.num_prompt_tokens])
            if ref is None:
                if prompt in self.seeded_prompts:  # a tree every step, same shape
                    last = int(ctx_tokens[-1])
                    tokens[i] = [(last * 31 + 17 * (k + 1)) % 49152
                                 for k in range(budget)]
                    parents[i] = SEEDED_TREE[:budget]
                continue
            truth = [int(t) for t in ref[len(ctx_tokens):]]
            rng = np.random.default_rng(len(ctx_tokens))
            right = int(rng.integers(0, 4))  # the right branch's correct depth
            if prompt in self.chain_prompts:
                tokens[i] = (truth[:right] + [truth[right] + 1 if right < len(truth)
                                              else 1])[:budget]
                continue
            toks, par = tree_around(truth, right, budget)
            tokens[i], parents[i] = toks, par
        return Drafts(tokens, None, None, parents)


def tree_around(truth, right, budget):
    """At each level a wrong node first, then the next node of the right
    branch (correct for ``right`` levels, then wrong); the wrong node of
    the first level gets a child, so indices and depths differ everywhere."""
    toks, par = [], []

    def add(token, parent):
        if len(toks) >= budget:
            return None
        toks.append(int(token) % 49152)
        par.append(parent)
        return len(toks) - 1

    parent = -1
    for depth, want in enumerate(truth):
        wrong = add(want + 7, parent)
        if depth == 0 and wrong is not None:
            add(want + 11, wrong)
        node = add(want if depth < right else want + 3, parent)
        if node is None:
            break
        parent = node
    return toks, par


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests.tiny_model import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("tree") / "llama")


def engine(model, spec):
    from vllm import LLM

    return LLM(model=model, dtype="float32", max_model_len=256, max_num_seqs=4,
               enforce_eager=True, seed=0, speculative_config=spec,
               block_size=BLOCK_SIZE, use_tqdm_on_load=False)


def requests(prompt_ids, refs=None):
    """First wave: the prompts; second wave: each prompt plus EXTEND tokens
    of its reference output (prefix cache hits on tree-filled blocks)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                   ignore_eos=True, logprobs=1)
    first = [(TokensPrompt(prompt_token_ids=p), with_logprobs if i == 2 else greedy)
             for i, p in enumerate(prompt_ids)]
    if refs is None:
        return first, []
    second = [(TokensPrompt(prompt_token_ids=p + r[:EXTEND]), greedy)
              for p, r in zip(prompt_ids, refs)]
    return first, second


def generate(llm, batch, cached: list | None = None):
    """Output token ids; each prompt's prefix-cache hit count into ``cached``."""
    outs = llm.generate([p for p, _ in batch], [s for _, s in batch], use_tqdm=False)
    if cached is not None:
        cached.extend(int(o.num_cached_tokens or 0) for o in outs)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory):
    """Plain decoding: batch 4, batch 1, and the second wave."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompt_ids = [tok(p)["input_ids"] for p in PROMPTS]
    llm = engine(tiny_model, None)
    try:
        first, _ = requests(prompt_ids)
        batch4 = generate(llm, first)
        batch1 = [generate(llm, [r])[0] for r in first[:2]]
        _, second = requests(prompt_ids, batch4)
        wave2 = generate(llm, second)
    finally:
        shutdown(llm)
    path = tmp_path_factory.mktemp("oracle") / "oracle.json"
    seqs = [p + o for p, o in zip(prompt_ids, batch4)]
    path.write_text(json.dumps({"sequences": seqs,
                                "chain_prompts": [prompt_ids[1], prompt_ids[3]],
                                "seeded_prompts": [tok(SEEDED_PROMPT)["input_ids"]]}))
    return {"prompt_ids": prompt_ids, "batch4": batch4, "batch1": batch1,
            "wave2": wave2, "oracle": str(path)}


def run_oracle_engine(tiny_model: str, oracle: str, prompt_ids, batch4, out: str) -> None:
    """The oracle engine's outputs and stats into ``out`` (JSON). Runs in a
    fresh process: the engine core must run in-process (it looks methods up
    by name, and a method registered here exists only here), and vLLM's
    worker start-up scan over ``sys.modules`` fails on objects other tests
    leave imported in the pytest process (llvmlite's function wrappers)."""
    from vllm_plugins.bench.engines import engine_stats
    from vllm_plugins.registry import register_method

    os.environ[ORACLE_ENV] = oracle
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    register_method("tree_oracle_test", f"{__name__}.OracleTreeProposer")
    # Fixed draft lengths: every step of the seeded request verifies a tree.
    llm = engine(tiny_model, {"method": "tree_oracle_test", "num_speculative_tokens": NODES,
                              "draft_length": "fixed"})
    try:
        routes = {"at start": llm.collective_rpc(tree_routes)[0]}
        first, _ = requests(prompt_ids)
        got4 = generate(llm, first)
        routes["after trees"] = llm.collective_rpc(tree_routes)[0]
        got1 = [generate(llm, [r])[0] for r in first[:2]]
        _, second = requests(prompt_ids, batch4)
        cached: list[int] = []
        wave2 = generate(llm, second, cached)
        stats = engine_stats(llm)
        seeded = seeded_runs(llm, prompt_ids)
    finally:
        shutdown(llm)
    with open(out, "w") as f:
        json.dump({"got4": got4, "got1": got1, "wave2": wave2, "cached": cached,
                   "stats": stats, "seeded": seeded, "routes": routes}, f)


def seeded_runs(llm, prompt_ids):
    """The seeded request's tokens alone, beside a prefill (a request that
    arrives while it decodes) and beside chain requests (which ask for
    logprobs, so their trees go out as chains), with the engine's tree
    counters over each run."""
    from vllm import SamplingParams

    from vllm_plugins.bench.engines import engine_stats

    eng = llm.llm_engine
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=SEEDED_TOKENS,
                            ignore_eos=True)
    prompt = {"prompt_token_ids": llm.get_tokenizer()(SEEDED_PROMPT)["input_ids"]}
    chain = SamplingParams(temperature=0.0, max_tokens=SEEDED_TOKENS, ignore_eos=True,
                           logprobs=1)
    prefill = SamplingParams(temperature=0.0, max_tokens=1)
    out = {}
    for name in ("alone", "beside a prefill", "beside chains"):
        before = engine_stats(llm)
        eng.add_request(f"{name}-seeded", prompt, seeded)
        if name == "beside chains":
            for k in (1, 3):
                eng.add_request(f"{name}-{k}", {"prompt_token_ids": prompt_ids[k]}, chain)
        steps, tokens = 0, []
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.request_id == f"{name}-seeded" and o.finished:
                    tokens = list(o.outputs[0].token_ids)
            steps += 1
            if name == "beside a prefill" and steps in (3, 9):
                eng.add_request(f"{name}-{steps}", {"prompt_token_ids": prompt_ids[0]},
                                prefill)
        after = engine_stats(llm)
        out[name] = {"tokens": tokens, **{k: after[k] - before[k]
                                          for k in ("tree_steps", "tree_only_steps")}}
    return out


@pytest.fixture(scope="module")
def oracle_run(tiny_model, reference, tmp_path_factory):
    """run_oracle_engine's result, in a fresh process."""
    import subprocess
    import sys

    tmp_path = tmp_path_factory.mktemp("oracle_run")
    args = tmp_path / "args.json"
    out = tmp_path / "out.json"
    args.write_text(json.dumps([str(tiny_model), reference["oracle"],
                                reference["prompt_ids"], reference["batch4"], str(out)]))
    code = ("import json, sys; from tests.test_tree_e2e import run_oracle_engine; "
            "run_oracle_engine(*json.load(open(sys.argv[1])))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code, str(args)], cwd=root,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_greedy_tree_output_is_plain_decoding(reference, oracle_run):
    result = oracle_run
    got4, got1, wave2, stats = (result["got4"], result["got1"], result["wave2"],
                                result["stats"])
    assert stats["proposer"]["num_errors"] == 0, stats
    # Teeth: tree steps ran, paths were accepted off the chain's indices.
    assert stats["tree_steps"] > 0 and stats["kv_moved"] > 0, stats
    # Both sampler paths ran: steps of trees only (batch 1; vLLM's sampler
    # skipped) and steps beside chain requests (batch 4).
    assert 0 < stats["tree_only_steps"] < stats["tree_steps"], stats
    assert stats["accepted"] > 0, stats
    # The runner and every attention layer carry our tree route from the
    # first tree on, and not before.
    start, after = result["routes"]["at start"], result["routes"]["after trees"]
    assert after["layers"] > 0 and after["routed_layers"] == after["layers"], after
    assert after["runner"] == ["tree.depth_positions", "tree.forward_plan"], after
    assert start == {**after, "routed_layers": 0, "runner": []}, start
    for i, (g, w) in enumerate(zip(got4, reference["batch4"])):
        assert g == w, ("batch 4", i)
    for i, (g, w) in enumerate(zip(got1, reference["batch1"])):
        assert g == w, ("batch 1", i)
    # The second wave read its first block from the cache the first wave's
    # tree steps (tree prompts) and chain steps filled, and decodes as plain.
    for i, (prompt, hit) in enumerate(zip(reference["prompt_ids"], result["cached"])):
        assert hit >= BLOCK_SIZE, ("no prefix-cache hit for second-wave prompt", i,
                                   len(prompt) + EXTEND, result["cached"])
    for i, (g, w) in enumerate(zip(wave2, reference["wave2"])):
        assert g == w, ("prefix-cached second wave", i)


def test_a_seeded_tree_request_samples_the_same_beside_any_request(oracle_run):
    """Sampled at temperature 1 with a seed, drafted a tree every step: the
    tokens alone (every step a step of trees only: vLLM's sampler skipped),
    beside a prefill and beside chain requests (steps where vLLM's sampler
    runs for the chains and the prefill) are the same."""
    runs = oracle_run["seeded"]
    alone = runs["alone"]
    assert len(alone["tokens"]) == SEEDED_TOKENS, runs
    assert alone["tree_steps"] > 0 and alone["tree_only_steps"] == alone["tree_steps"], runs
    for name in ("beside a prefill", "beside chains"):
        # Teeth: steps mixed the tree request with requests vLLM samples.
        assert runs[name]["tree_only_steps"] < runs[name]["tree_steps"], (name, runs)
        assert runs[name]["tokens"] == alone["tokens"], (name, runs)


# ------------------------------------------------------ the default model
# STAND's trees (its draft_shape option) against its chain with the same
# node budget, greedy, on prompts that repeat with variations: where the
# next word is ambiguous a tree holds several candidates, a chain one.
REPEATS = [
    "Monday: eggs. Tuesday: toast. Monday: eggs. Wednesday: rice. Monday: eggs. "
    "Tuesday: toast. Monday: eggs. Wednesday: rice. Monday: eggs. Tuesday:",
    "The cat sat on the mat. The dog sat on the rug. The cat sat on the mat. "
    "The dog sat on the rug. The cat sat on the mat. The dog sat on the",
]
SMOL_TOKENS = 64


def smol_engine(model_path, spec):
    from vllm import LLM

    return LLM(model=model_path, dtype="float32", max_model_len=512, max_num_seqs=2,
               enforce_eager=True, seed=0, speculative_config=spec,
               use_tqdm_on_load=False)


def smol_run(llm):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=SMOL_TOKENS, ignore_eos=True)
    outs = llm.generate(REPEATS, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def smol_plain(base):
    """Plain decoding of REPEATS on the default model: the session's engine
    without speculation (tests/conftest.py), no engine start of its own."""
    return smol_run(base)


def test_stand_tree_on_default_model_is_exact_and_beats_its_chain(model_path, smol_plain):
    from vllm_plugins.bench.engines import engine_stats

    results = {"plain": (smol_plain, None)}
    # Fixed drafts: every node verified, so MAT compares what each shape
    # drafts (under goodput, STAND's default, it follows the step times).
    for name, spec in (("chain", {"method": "stand", "num_speculative_tokens": NODES,
                                  "draft_length": "fixed"}),
                       ("tree", {"method": "stand", "num_speculative_tokens": NODES,
                                 "draft_shape": "tree", "draft_length": "fixed"})):
        llm = smol_engine(model_path, spec)
        try:
            results[name] = (smol_run(llm), engine_stats(llm) if spec else None)
        finally:
            shutdown(llm)
    want = results["plain"][0]
    for name in ("chain", "tree"):
        got, stats = results[name]
        assert stats["proposer"]["num_errors"] == 0, (name, stats)
        for i, (g, w) in enumerate(zip(got, want)):
            assert g == w, (name, i)
    tree, chain = results["tree"][1], results["chain"][1]
    assert tree["tree_steps"] > 0, tree
    mat = {k: s["tokens"] / s["steps"] for k, s in (("tree", tree), ("chain", chain))}
    assert mat["tree"] > mat["chain"], mat


def test_token_recycling_trees_under_goodput_are_plain_decoding(model_path, smol_plain):
    """Token Recycling's trees with the goodput policy choosing which nodes
    to verify each step (the default with draft_shape "tree"): subsets of
    each tree re-laid in path-probability order, or its best path as a
    chain. Greedy output is plain decoding's."""
    from vllm_plugins.bench.engines import engine_stats

    llm = smol_engine(model_path, {"method": "token_recycling", "num_speculative_tokens": 16,
                                   "draft_shape": "tree"})
    try:
        got, stats = smol_run(llm), engine_stats(llm)
    finally:
        shutdown(llm)
    assert stats["proposer"]["num_errors"] == 0, stats
    trees = stats["proposer"]["draft_length"]["trees"]
    assert trees["rows"] > 0 and trees["mean_nodes_kept"] > 0, trees
    assert trees["nodes_observed"] > 0, trees
    assert stats["tree_steps"] > 0, stats
    for i, (g, w) in enumerate(zip(got, smol_plain)):
        assert g == w, i


def test_grammar_forced_around_a_stand_tree_verifies_trees(model_path, smol_plain):
    """``grammar_forced`` passes its inner's trees through for requests
    without a grammar: tree steps run, and greedy output is plain decoding's."""
    from vllm_plugins.bench.engines import engine_stats

    llm = smol_engine(model_path, {"method": "grammar_forced", "num_speculative_tokens": NODES,
                                   "inner": {"method": "stand", "draft_shape": "tree"}})
    try:
        got, stats = smol_run(llm), engine_stats(llm)
    finally:
        shutdown(llm)
    assert stats["proposer"]["num_errors"] == 0, stats
    assert stats["tree_steps"] > 0, stats
    for i, (g, w) in enumerate(zip(got, smol_plain)):
        assert g == w, i
