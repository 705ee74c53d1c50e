"""Grammar-aligned sampling (ASAp) against the exact grammar-conditioned distribution.

No engine: a tiny random Llama (``tests.tiny_model.tiny_llama``, the default
model's tokenizer) gives the next-token logits, and ``GrammarLogitsProcessor``
is driven the way vLLM's V1 sampler drives it (``update_state`` with a
``BatchUpdate``, ``apply`` on the raw logits row, then a temperature-scaled
draw). The grammar's language is finite, so the model's distribution
conditioned on the grammar is computed exactly by enumerating every token
sequence the grammar admits (llguidance admits non-canonical tokenizations,
so "true" can be spelled "t"+"rue": plain masking gives such spellings the full
probability of their first token, while the model would rarely finish them).

The checks: plain masking's own sampling distribution (also enumerated) is far
from the target; ASAp's later samples are close to it; with ASAp's update step
switched off the improvement is gone; every bound in the trie stays above the
exact expected future grammaticality.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from tests.processor_fixtures import processor_fixtures

pytest.importorskip("vllm")
pytest.importorskip("llguidance")
pytest.importorskip("transformers")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate  # noqa: E402

from vllm_plugins.logits_processors import asap  # noqa: E402
from vllm_plugins.logits_processors.grammar import GrammarLogitsProcessor  # noqa: E402
from vllm_plugins.grammar.spec import (  # noqa: E402
    GrammarSpecError,
    compile_grammar_request,
    validate_grammar_request,
)

LARK = 'start: "true" | "false" | "unknown"'
PROMPT_TEXT = "Answer with one word:"
MAX_TOKENS = 12  # longer than any token sequence of the language
N_SAMPLES = 300
LATER = 200  # the last LATER samples are compared with the target


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Row-sized torch ops are far slower with 2 threads on a loaded 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.tiny_model import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("asap") / "tiny", num_layers=2)


@pytest.fixture(scope="module")
def lm(model_dir):
    """Next-token logits of the tiny Llama, cached by prefix (the model is deterministic)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def logits(ids: tuple[int, ...]) -> torch.Tensor:
        if ids not in cache:
            with torch.no_grad():
                cache[ids] = model(torch.tensor([ids])).logits[0, -1].float()
        return cache[ids]

    return logits


vllm_config, tokenizer = processor_fixtures("model_dir", max_model_len=256)


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tuple(tokenizer.encode(PROMPT_TEXT, add_special_tokens=False))


def params(aligned: bool, temperature: float, eos: int) -> SamplingParams:
    sp = SamplingParams(
        temperature=temperature, max_tokens=MAX_TOKENS,
        extra_args={"grammar": {"lark": LARK, "aligned": aligned}},
    )
    sp.update_from_generation_config({}, eos)
    return sp


# ---------------------------------------------------------------- enumeration
def enumerate_language(proc, lm, prompt, eos, temperature, trie=None):
    """Every admitted token sequence with its exact probability under two samplers.

    Returns {sequence: (p_model, p_sampler)}: p_model is the model's probability
    of the sequence followed by EOS, at this temperature (normalising it over
    the language gives the target); p_sampler is the probability that plain
    masking (renormalise over allowed tokens at each step) draws it, or, given
    an ASAp ``trie``, that ASAp draws it with the trie's present bounds.
    """
    rt = proc._get_runtime()
    matcher = rt.new_matcher(compile_grammar_request({"lark": LARK}))
    out: dict[tuple[int, ...], tuple[float, float]] = {}

    def allowed_now() -> list[int]:
        if matcher.is_stopped():
            return [eos]
        words = rt.fill([(matcher, 0)], 1)[:1]
        banned = rt.banned_tokens(words, rt.vocab_size, torch.device("cpu"))[0]
        return (~banned).nonzero().flatten().tolist()

    def walk(seq: tuple[int, ...], lp_model: float, lp_plain: float, node) -> None:
        logp = torch.log_softmax(lm(prompt + seq).double() / temperature, 0)
        allowed = allowed_now()
        children = (node.children or {}) if node is not None else {}
        weight = logp.clone()
        for t, child in children.items():
            weight[t] += child.log_efg
        log_norm = float(torch.logsumexp(weight[allowed], 0))
        for t in allowed:
            lm_t = lp_model + float(logp[t])
            pl_t = lp_plain + float(weight[t]) - log_norm
            if t == eos:
                out[seq] = (math.exp(lm_t), math.exp(pl_t))
                continue
            assert len(seq) < MAX_TOKENS - 1, "language longer than MAX_TOKENS"
            assert matcher.consume_token(t)
            walk(seq + (t,), lm_t, pl_t, children.get(t))
            matcher.rollback(1)

    walk((), 0.0, 0.0, None if trie is None else trie.root)
    return out


def exact_efg(proc, lm, prompt, eos, temperature):
    """EFG(prefix) = P(model finishes inside the language | prefix), every admitted prefix."""
    lang = enumerate_language(proc, lm, prompt, eos, temperature)
    efg: dict[tuple[int, ...], float] = {}
    for seq, (p, _) in lang.items():
        for k in range(len(seq) + 1):
            efg[seq[:k]] = efg.get(seq[:k], 0.0) + p
    # divide by P(prefix) under the model
    for pre in list(efg):
        lp = 0.0
        for k in range(len(pre)):
            logp = torch.log_softmax(lm(prompt + pre[:k]).double() / temperature, 0)
            lp += float(logp[pre[k]])
        efg[pre] /= math.exp(lp)
    return efg


def by_text(tokenizer, dist: dict[tuple[int, ...], float]) -> dict[str, float]:
    merged: Counter = Counter()
    for seq, p in dist.items():
        merged[tokenizer.decode(list(seq))] += p
    return dict(merged)


def tv(p: dict, q: dict) -> float:
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in set(p) | set(q))


# ------------------------------------------------------------------- sampling
def sample(proc, lm, prompt, sp, n, seed, log_weights=None):
    """n requests one after another (index 0 of the batch), as vLLM's V1 sampler runs them.
    ``log_weights``: a list that gets each output's summed AWRS log weight."""
    gen = torch.Generator().manual_seed(seed)
    eos = sp.eos_token_id
    outs = []
    for _ in range(n):
        out: list[int] = []
        proc.update_state(BatchUpdate(batch_size=1, removed=[],
                                      added=[(0, sp, list(prompt), out)], moved=[]))
        if log_weights is not None:
            log_weights.append(0.0)
        while True:
            row = lm(prompt + tuple(out)).clone()[None]
            row = proc.apply(row)
            if log_weights is not None:
                log_weights[-1] += sum(proc.take_awrs_weights().get(0, []))
            probs = torch.softmax(row[0].double() / sp.temperature, 0)
            tok = int(torch.multinomial(probs, 1, generator=gen))
            out.append(tok)
            if tok == eos or len(out) >= sp.max_tokens:
                break
            proc.update_state(None)
        proc.update_state(BatchUpdate(batch_size=0, removed=[0], added=[], moved=[]))
        outs.append(tuple(out[:-1]) if out[-1] == eos else tuple(out))
    return outs


def empirical(tokenizer, outs) -> dict[str, float]:
    c = Counter(tokenizer.decode(list(o)) for o in outs)
    return {k: v / len(outs) for k, v in c.items()}


def noise_bound(target: dict[str, float], n: int) -> float:
    """3x the expected TV of an n-sample empirical distribution (sum of binomial sds)."""
    return 3 * 0.5 * sum(math.sqrt(p * (1 - p) / n) for p in target.values()) + 0.01


# ---------------------------------------------------------------------- tests
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_asap_converges_to_grammar_conditioned_distribution(
    vllm_config, lm, tokenizer, prompt, temperature, monkeypatch
):
    eos = tokenizer.eos_token_id
    proc = GrammarLogitsProcessor(vllm_config, torch.device("cpu"), False)
    lang = enumerate_language(proc, lm, prompt, eos, temperature)
    z = sum(p for p, _ in lang.values())
    target = by_text(tokenizer, {s: p / z for s, (p, _) in lang.items()})
    plain_exact = by_text(tokenizer, {s: q for s, (_, q) in lang.items()})
    assert abs(sum(plain_exact.values()) - 1) < 1e-6
    # Plain masking distorts: its exact sampling distribution is far from the target.
    distortion = tv(plain_exact, target)
    assert distortion > 0.3, (distortion, target, plain_exact)

    # Plain masking, sampled through the processor: matches its own enumeration
    # (the harness is right) and stays far from the target.
    plain = empirical(tokenizer, sample(proc, lm, prompt, params(False, temperature, eos),
                                        LATER, seed=1))
    assert tv(plain, plain_exact) < noise_bound(plain_exact, LATER)
    assert tv(plain, target) > distortion - noise_bound(plain_exact, LATER)

    # ASAp: the later samples follow the target.
    sp = params(True, temperature, eos)
    outs = sample(proc, lm, prompt, sp, N_SAMPLES, seed=2)
    later = empirical(tokenizer, outs[-LATER:])
    bound = noise_bound(target, LATER)
    assert tv(later, target) < bound, (tv(later, target), later, target)
    # The two outcomes cannot be confused: "close" and "far" do not overlap.
    assert bound < distortion - noise_bound(plain_exact, LATER)

    # Every bound in the trie is >= the exact EFG (soundness), and the root's
    # bound has come down from 1 towards P(grammatical).
    efg = exact_efg(proc, lm, prompt, eos, temperature)
    (trie,) = proc._asap._tries.values()

    def check(node, pre):
        # float32 logits: log-probabilities carry ~1e-6 absolute error each
        assert math.exp(node.log_efg) >= efg.get(pre, 0.0) * (1 - 1e-4), pre
        for t, child in (node.children or {}).items():
            check(child, pre + (t,))

    check(trie.root, ())
    assert trie.bound() < 0.5 and trie.bound() >= z * (1 - 1e-4)
    # ASAp's sampling distribution with the bounds learnt so far, enumerated:
    # it has (nearly) reached the target.
    now = enumerate_language(proc, lm, prompt, eos, temperature, trie)
    now = by_text(tokenizer, {s: q for s, (_, q) in now.items()})
    assert tv(now, target) < 0.01, (tv(now, target), now, target)

    # The processor's row is exactly that distribution once the sampler divides
    # by the temperature (the offsets are T * log E~, not log E~).
    out: list[int] = []
    proc.update_state(BatchUpdate(batch_size=1, removed=[], added=[(0, sp, list(prompt), out)],
                                  moved=[]))
    row = proc.apply(lm(prompt).clone()[None])[0]
    proc.update_state(BatchUpdate(batch_size=0, removed=[0], added=[], moved=[]))
    got = torch.softmax(row.double() / temperature, 0)
    want = torch.log_softmax(lm(prompt).double() / temperature, 0)
    for t, child in trie.root.children.items():
        want[t] += child.log_efg
    want = torch.softmax(want.masked_fill(~torch.isfinite(row), float("-inf")), 0)
    assert 0.5 * float((got - want).abs().sum()) < 1e-4

    # Switch ASAp's update step off: the improvement is gone (it is plain masking).
    monkeypatch.setattr(asap.AsapTrie, "update", staticmethod(lambda path: None))
    proc_off = GrammarLogitsProcessor(vllm_config, torch.device("cpu"), False)
    off = empirical(tokenizer, sample(proc_off, lm, prompt, sp, N_SAMPLES, seed=2)[-LATER:])
    print(f"\nT={temperature}: TV to target: plain exact {distortion:.3f}, plain sampled "
          f"{tv(plain, target):.3f}, ASAp last {LATER} {tv(later, target):.3f} "
          f"(bound {bound:.3f}), ASAp enumerated {tv(now, target):.4f}, "
          f"no update {tv(off, target):.3f}; target {target}")
    assert tv(off, target) > distortion - noise_bound(plain_exact, LATER)


def test_requests_without_the_option_build_no_asap_state(vllm_config, lm, tokenizer, prompt):
    eos = tokenizer.eos_token_id
    proc = GrammarLogitsProcessor(vllm_config, torch.device("cpu"), False)
    sample(proc, lm, prompt, params(False, 1.0, eos), 3, seed=0)
    assert proc._asap is None
    sample(proc, lm, prompt, params(True, 1.0, eos), 3, seed=0)
    assert len(proc._asap) == 1
    # Another prompt or temperature gets its own trie.
    sample(proc, lm, prompt[1:], params(True, 1.0, eos), 1, seed=0)
    sample(proc, lm, prompt, params(True, 0.5, eos), 1, seed=0)
    assert len(proc._asap) == 3


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_bad_aligned_value_is_a_clear_error(value):
    with pytest.raises(GrammarSpecError, match=r'\["aligned"\] must be true or false'):
        validate_grammar_request({"grammar": {"regex": "a+", "aligned": value}})


def test_aligned_needs_sampling():
    sp = SamplingParams(temperature=0.0, extra_args={"grammar": {"regex": "a+", "aligned": True}})
    with pytest.raises(GrammarSpecError, match=r'\["aligned"\] needs random sampling'):
        GrammarLogitsProcessor.validate_params(sp)
    GrammarLogitsProcessor.validate_params(
        SamplingParams(temperature=0.8, extra_args={"grammar": '{"regex": "a+", "aligned": true}'})
    )


# ------------------------------------------------------- the trie on its own
def _walk(store, key, steps, temperature=1.0):
    """One sample through ``store``: steps = [(raw row, masked row, sampled token)]."""
    cur = store.cursor(key, terminal=(0,), temperature=temperature)
    for raw, masked, tok in steps:
        cur.observe(raw, masked)
        cur.advance([tok])
    cur.finish()
    return cur


def test_update_subtracts_dead_mass_and_reweights():
    # Vocab {0: EOS, 1: a, 2: b}; at the root a and b are allowed (p = 0.5, 0.25);
    # after "a" only EOS is allowed, with p = 0.1.
    store = asap.AsapStore(100)
    key = store.key("g", [5], "T=1")
    root_raw = torch.log(torch.tensor([0.25, 0.5, 0.25]))
    root_mask = torch.tensor([float("-inf"), 0.0, 0.0])
    a_raw = torch.log(torch.tensor([0.1, 0.6, 0.3]))
    a_mask = torch.tensor([0.0, float("-inf"), float("-inf")])
    _walk(store, key, [(root_raw, root_mask, 1), (a_raw, a_mask, 0)])
    trie = store.trie(key)
    (child,) = trie.root.children.values()
    assert math.isclose(math.exp(child.log_efg), 0.1, rel_tol=1e-6)
    # root: unexplored b (0.25) + a (0.5 * 0.1)
    assert math.isclose(trie.bound(), 0.25 + 0.05, rel_tol=1e-6)
    # Next sample at the root: "a" is reweighted by log 0.1 (times T).
    cur = store.cursor(key, terminal=(0,), temperature=2.0)
    toks, offsets = cur.observe(root_raw, root_mask)
    assert toks == [1] and math.isclose(offsets[0], 2.0 * math.log(0.1), rel_tol=1e-6)


def test_node_cap_evicts_least_recently_used_tries():
    store = asap.AsapStore(max_nodes=5)
    raw = torch.zeros(4)
    mask = torch.zeros(4)
    keys = [store.key("g", [i], "") for i in range(3)]
    _walk(store, keys[0], [(raw, mask, 1), (raw, mask, 2)])  # 3 nodes
    _walk(store, keys[1], [(raw, mask, 1)])  # 2 nodes: 5 in all
    assert store.n_nodes == 5 and len(store) == 2
    store.trie(keys[0])  # keys[0] used last: keys[1] is the LRU one
    _walk(store, keys[2], [(raw, mask, 3)])
    assert len(store) == 2 and keys[1] not in store._tries
    assert store.n_nodes <= 5
    # A trie alone at the cap stops growing, and its sample still finishes.
    solo = asap.AsapStore(max_nodes=2)
    cur = _walk(solo, keys[0], [(raw, mask, 1), (raw, mask, 2), (raw, mask, 3)])
    assert solo.n_nodes == 2 and cur.done and len(cur.path) == 2


def test_max_nodes_env_is_validated(monkeypatch):
    monkeypatch.setenv(asap.MAX_NODES_ENV, "lots")
    with pytest.raises(ValueError, match=asap.MAX_NODES_ENV):
        asap.max_nodes_from_env()
    monkeypatch.setenv(asap.MAX_NODES_ENV, "123")
    assert asap.max_nodes_from_env() == 123


# ------------------------------------------------------- under speculation
# The processor is driven as vLLM's rejection sampler drives it under our
# bridge (tests/test_processors_speculation.py runs the sampler itself): the
# step's drafts handed over, the bonus row (after all drafts) through
# ``apply``, the target rows (row j: after drafts[:j]) through
# ``apply_drafted``; the runner then appends the accepted drafts and one
# sampled token to the output. The reference is plain decoding of the same
# trie (a deep copy), one position per step.
#: Branches at every position (LARK's words are forced after their first
#: token), so that drafted rows have several children to weigh.
DIGITS = r"[0-9]{1,3}"


def digits_params(eos: int, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    sp = SamplingParams(temperature=1.0, max_tokens=max_tokens,
                        extra_args={"grammar": {"regex": DIGITS, "aligned": True}})
    sp.update_from_generation_config({}, eos)
    return sp


def trained(vllm_config, lm, prompt, eos, n=12):
    """A processor whose trie has learnt from ``n`` aligned samples."""
    proc = GrammarLogitsProcessor(vllm_config, torch.device("cpu"), False)
    sample(proc, lm, prompt, digits_params(eos), n, seed=3)
    return proc


def fork(vllm_config, proc):
    """A fresh processor holding a copy of ``proc``'s tries."""
    import copy

    other = GrammarLogitsProcessor(vllm_config, torch.device("cpu"), False)
    other._get_runtime()
    other._asap = copy.deepcopy(proc._asap)
    return other


def prefixes_with_children(trie):
    """The prefixes of the trie's nodes that have children, longest first."""
    out = []

    def walk(node, pre):
        if node.children:
            out.append(pre)
            for t, c in node.children.items():
                walk(c, pre + (t,))

    walk(trie.root, ())
    return sorted(out, key=len, reverse=True)


def add(proc, sp, prompt, out):
    proc.update_state(BatchUpdate(batch_size=1, removed=[], added=[(0, sp, list(prompt), out)],
                                  moved=[]))


def remove(proc):
    proc.update_state(BatchUpdate(batch_size=0, removed=[0], added=[], moved=[]))


def plain_rows(proc, lm, prompt, sp, tokens, end=True):
    """Plain decoding committing ``tokens`` one step each: the processed row
    at each position; the request leaves the batch after the last token if
    ``end`` (its sample is over), else one more row is processed."""
    out: list[int] = []
    add(proc, sp, prompt, out)
    rows = []
    for tok in tokens:
        rows.append(proc.apply(lm(prompt + tuple(out)).clone()[None])[0])
        out.append(tok)
        proc.update_state(None)
    if not end:
        rows.append(proc.apply(lm(prompt + tuple(out)).clone()[None])[0])
    remove(proc)
    return rows


def spec_step(proc, lm, prompt, sp, drafts, committed, end=True):
    """One speculative step with ``drafts``, the runner committing
    ``committed``; then as plain_rows. Returns the step's rows by position
    (len(drafts) + 1) and the rows of the next step, if any."""
    out: list[int] = []
    add(proc, sp, prompt, out)
    rows = torch.stack([lm(prompt + tuple(drafts[:j])) for j in range(len(drafts) + 1)])
    proc.begin_verification([list(drafts)])
    try:
        bonus = proc.apply(rows[-1:].clone())  # the plain sampler's rows come first
        target = proc.apply_drafted(rows[:-1].clone(), [len(drafts)])
    finally:
        proc.end_verification()
    step = list(target) + [bonus[0]]
    out.extend(committed)
    proc.update_state(None)
    after = []
    if not end:
        after.append(proc.apply(lm(prompt + tuple(out)).clone()[None])[0])
    remove(proc)
    return step, after


def same_rows(a, b):
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    return torch.equal(fa, fb) and torch.allclose(a[fa], b[fb], rtol=0, atol=1e-5)


def trie_state(trie):
    """Every node's (prefix, log_p, log_mass, log_efg), for exact comparison."""
    out = {}

    def walk(node, pre):
        out[pre] = (round(node.log_p, 9), None if node.log_mass is None else
                    round(node.log_mass, 9), round(node.log_efg, 9))
        for t, c in (node.children or {}).items():
            walk(c, pre + (t,))

    walk(trie.root, ())
    return out


def grammatical(row, but=()):
    return [t for t in torch.isfinite(row).nonzero().flatten().tolist() if t not in but]


@pytest.mark.parametrize("case", ["none", "one", "all", "ends", "max_tokens"])
def test_drafted_rows_get_plain_decodings_weights_and_only_commits_teach(
    vllm_config, lm, tokenizer, prompt, case
):
    eos = tokenizer.eos_token_id
    sp = digits_params(eos)
    base = trained(vllm_config, lm, prompt, eos)
    (trie,) = base._asap._tries.values()
    # The drafts go down the trie to a node with children (its row is
    # reweighted), then take a token the grammar allows there that is not in
    # the trie yet: committed, it would add a node.
    path = None
    for prefix in prefixes_with_children(trie):
        if not prefix:
            continue
        node = trie.root
        for t in prefix:
            node = node.children[t]
        probe = plain_rows(fork(vllm_config, base), lm, prompt, sp, prefix, end=False)[-1]
        new = grammatical(probe, but=(eos, *node.children))[:1]
        if new:
            path = list(prefix) + new
            break
    assert path is not None
    n = len(path)
    assert n >= 2, path
    # Plain decoding's rows along the drafts, and one after them.
    ref = plain_rows(fork(vllm_config, base), lm, prompt, sp, path, end=False)

    drafts, end = list(path), False
    if case in ("none", "one"):  # rejected at position a: another token sampled there
        a = 0 if case == "none" else 1
        committed = path[:a] + grammatical(ref[a], but=(path[a], eos))[:1]
    elif case == "all":  # all accepted, and the bonus token
        committed = path + (grammatical(ref[n], but=(eos,))[:1] or [eos])
        end = committed[-1] == eos
    elif case == "ends":  # the sample ends inside the step; the runner's
        drafts = path + [eos]  # list holds a bonus token past its end
        committed, end = drafts + [7], True
    else:  # the step overshoots max_tokens: the sample ends at the limit
        sp = digits_params(eos, max_tokens=2)
        committed, end = path + [eos], True

    spec = fork(vllm_config, base)
    step, after = spec_step(spec, lm, prompt, sp, drafts, committed, end=end)
    # Every row of the step is the row plain decoding gives its position.
    for j in range(n + 1):
        assert same_rows(step[j], ref[j]), f"position {j}"
    # The test can fail: ASAp moved rows after drafts, not only the first.
    moved = [j for j in range(1, n + 1) if not same_rows(
        step[j], plain_masked(vllm_config, prompt, eos, path[:j], lm(prompt + tuple(path[:j]))))]
    assert moved, "no drafted row was reweighted"

    # After the step the trie holds what plain decoding committing the same
    # tokens holds (nothing of the rejected drafts), its bounds tightened
    # alike at the sample's end.
    plain = fork(vllm_config, base)
    kept = committed
    if end:
        kept = committed[:committed.index(eos) + 1] if eos in committed else committed
        kept = kept[:sp.max_tokens]
    want = plain_rows(plain, lm, prompt, sp, kept, end=end)
    assert len(after) == (0 if end else 1)
    for got, row in zip(after, want[-1:]):
        assert same_rows(got, row)
    (got_trie,) = spec._asap._tries.values()
    (want_trie,) = plain._asap._tries.values()
    got_state = trie_state(got_trie)
    assert got_state == trie_state(want_trie)
    # The test can fail: the last draft makes a node only where it was
    # committed and the sample went on after it (its last token is not followed).
    assert (tuple(path) in got_state) == (committed[:n] == path and sp.max_tokens > n)


def plain_masked(vllm_config, prompt, eos, output, row):
    """The row masked by the grammar alone (no ASAp), after ``output``."""
    proc = GrammarLogitsProcessor(vllm_config, torch.device("cpu"), False)
    sp = digits_params(eos)
    sp.extra_args = {"grammar": {"regex": DIGITS}}
    add(proc, sp, prompt, list(output))
    return proc.apply(row.clone()[None])[0]
