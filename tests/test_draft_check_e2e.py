"""A proposer that returns malformed drafts inside vLLM's engine: the engine
lives, and greedy output is plain decoding's.

``MalformedProposer`` (registered for this module only, as another package
would register its method) drafts a repeat of the last token, and every
other step breaks one request's draft in one of the ways
``vllm_plugins.tree.checked`` refuses: parents of the wrong length, a parent
after its child, token ids outside the vocabulary. Each such request loses
that step's draft; every output must equal plain decoding's.
"""

import json
import os

import pytest

from tests.conftest import shutdown
from vllm_plugins.proposers.base import PluginProposer
from vllm_plugins.step_context import Drafts

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
PROMPTS = [[1, 2, 3, 4, 5], [7, 7, 7, 7], [11, 12, 13, 11, 12, 13], [20, 21]]


class MalformedProposer(PluginProposer):
    """Test-only: a last-token repeat, with every other step's draft of one
    request broken (see the module doc)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps = 0

    def draft(self, ctx):
        self.steps += 1
        vocab = int(self.vocab_size)
        tokens, parents = [[] for _ in ctx.requests], [None for _ in ctx.requests]
        rows = list(self.drafting_requests(ctx))
        for i, r, budget in rows:
            tokens[i] = [int(r.context[-1])] * min(3, budget)
        if rows and self.steps % 2 == 0:
            i = rows[(self.steps // 2) % len(rows)][0]
            kind = (self.steps // 2) % 4
            t = tokens[i] or [1]
            if kind == 0:
                tokens[i], parents[i] = t + t, [-1, -1]          # too few parents
            elif kind == 1:
                tokens[i], parents[i] = [t[0]] * 3, [-1, 2, 0]   # parent after child
            elif kind == 2:
                tokens[i], parents[i] = [t[0], vocab + 3], [-1, -1]  # tree over vocab
            else:
                tokens[i] = [t[0], vocab]                        # chain over vocab
        return Drafts(tokens, None, None, parents)


def run_engines(model: str, out: str) -> None:
    """Plain decoding, then the malformed proposer, in this process (the
    method is registered only here); outputs and stats into ``out``."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_plugins.bench.engines import engine_stats
    from vllm_plugins.registry import register_method

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    register_method("malformed_test", f"{__name__}.MalformedProposer")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
    got = {}
    for name, spec in (("plain", None),
                       ("malformed", {"method": "malformed_test",
                                      "num_speculative_tokens": 4,
                                      "draft_length": "fixed"})):
        llm = LLM(model=model, dtype="float32", max_model_len=256, max_num_seqs=4,
                  enforce_eager=True, seed=0, speculative_config=spec,
                  use_tqdm_on_load=False)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            got[name] = [list(o.outputs[0].token_ids) for o in outs]
            if spec is not None:
                got["stats"] = engine_stats(llm)
        finally:
            shutdown(llm)
    with open(out, "w") as f:
        json.dump(got, f)


def test_malformed_drafts_cost_drafts_not_the_engine(tmp_path):
    import subprocess
    import sys

    from tests.tiny_model import tiny_llama

    model = tiny_llama(tmp_path / "tiny", tie_word_embeddings=True,
                       initializer_range=0.05)
    out = tmp_path / "out.json"
    code = ("import sys; from tests.test_draft_check_e2e import run_engines; "
            "run_engines(sys.argv[1], sys.argv[2])")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code, model, str(out)], cwd=root,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(out.read_text())
    stats = got["stats"]
    assert stats["malformed_drafts"] > 0, stats
    assert stats["accepted"] > 0 and stats["proposer"]["num_errors"] == 0, stats
    assert got["malformed"] == got["plain"]
    assert "proposed a malformed draft" in proc.stderr + proc.stdout
