"""Engines on Model Runner V2, in a process of their own (the tests' V2 switch).

Triton must see its stand-in CPU backend and ``TRITON_INTERPRET=1`` before
it or vLLM is first imported (``vllm_plugins.v2_on_cpu``), which a pytest
worker that already ran other tests cannot promise. So tests/test_v2_e2e.py
runs this module as a script, one process a scenario with its engines one
after the other, and reads back one JSON object:

    python -m tests.v2_engines greedy   # tiny model: every method vs plain V2
    python -m tests.v2_engines preempted  # tiny model: preemption and an abort
    python -m tests.v2_engines draft_logits  # V2's rejection sampler, our rows
    python -m tests.v2_engines step_k     # tiny model: the step's k, by batch size and chosen
    python -m tests.v2_engines sampled    # seeded samples: stand, token_recycling vs plain V2

V2's own kernels run in Triton's interpreter here, so the scenarios keep to
short outputs; the tiny model is enough where only exactness is asked.
"""

from __future__ import annotations

import json
import os
import sys

from vllm_plugins.v2_on_cpu import enable

# Every method V2 serves, as a chain (V2 verifies chains).
V2_METHODS = {
    "token_recycling": {"method": "token_recycling"},
    # Its tables on the target's device: the step reads nothing back.
    "token_recycling_device": {"method": "token_recycling", "tables": "device"},
    # Fixed drafts: under its default goodput, whether STAND drafts at all
    # on a random model depends on the step times it measures, and every
    # method here must show drafts verified.
    "stand": {"method": "stand", "draft_length": "fixed"},
    "hybrid": {"method": "hybrid", "draft_shape": "chain"},
    "ngram_adaptive": {"method": "ngram_adaptive"},
    "grammar_forced": {"method": "grammar_forced", "inner": "token_recycling"},
    "grammar_forced_stand": {"method": "grammar_forced",
                             "inner": {"method": "stand", "draft_length": "fixed"}},
    "grammar_forced_hybrid": {"method": "grammar_forced",
                              "inner": {"method": "hybrid", "draft_shape": "chain"}},
    "grammar_forced_ngram_adaptive": {"method": "grammar_forced", "inner": "ngram_adaptive"},
}
# Served by V1 while it exists (bridge/v2/gate.py says why).
V1_METHODS = {"swift": {"method": "swift"}}
NUM_SPECULATIVE_TOKENS = 4
GREEDY_TOKENS = 24


def runner_of(llm) -> str:
    """``v2`` or ``v1``: the class of the worker's model runner."""
    from vllm_plugins.bench.engines import model_runner

    module = type(model_runner(llm)).__module__
    return "v2" if module.startswith(("vllm.v1.worker.gpu.", "vllm.v1.worker.cpu.")) else "v1"


def accepted_by_vllm(llm) -> int:
    """vLLM's own count of accepted draft tokens (its spec-decode metrics,
    which the scheduler keeps for either runner)."""
    return int(sum(m.value for m in llm.get_metrics()
                   if m.name == "vllm:spec_decode_num_accepted_tokens"))


def tiny_prompts() -> list[list[int]]:
    # Token ids (no tokenizer needed): a repeating pattern the tiny model's
    # output follows in runs (drafts accepted) and noise.
    return [[1, 2, 3, 4, 5, 6] * 4, [100, 200, 300], [7, 7, 7, 7, 7, 7, 7],
            [4000, 41, 4000, 41, 4000, 41, 4000], [11, 12, 13, 14, 15, 16, 17, 18]]


def greedy(tmp: str) -> dict:
    from vllm import SamplingParams

    from tests.tiny_model import tiny_llama
    from vllm_plugins.bench.engines import build_engine, engine_stats, shutdown_all

    path = tiny_llama(os.path.join(tmp, "tiny"), tie_word_embeddings=True,
                      initializer_range=0.05)
    prompts = [{"prompt_token_ids": p} for p in tiny_prompts()]
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    # A request that caps its own drafts (per-request options) rides along.
    capped = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True,
                            extra_args={"speculation": {"max_draft": 1}})
    # Sampling parameters V2's sampler applies to every verified row itself.
    processed = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True,
                               logit_bias={13206: -100.0, 34: 2.0}, min_tokens=6,
                               min_p=0.05)
    # Our grammar processor (vLLM loads it from its entry point) through
    # V2's own processor interface, on verified rows too.
    grammar = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, extra_args={
        "grammar": {"json_schema": {"type": "object", "properties": {
            "a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a", "b"]}}})
    out: dict = {}
    methods = {"plain": None, **V2_METHODS, **V1_METHODS}
    for name, spec in methods.items():
        if spec is not None:
            spec = {**spec, "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
                    "draft_length": "fixed"}
        llm = build_engine(path, spec, max_num_seqs=8, max_model_len=512)
        try:
            # Plain decoding refuses the per-request options (it has no drafts
            # to cap); its output for that prompt is the same either way.
            last = capped if spec is not None else params
            results = llm.generate(prompts + prompts[:3],
                                   [params] * len(prompts) + [last, processed, grammar],
                                   use_tqdm=False)
            out[name] = {"runner": runner_of(llm),
                         "tokens": [list(r.outputs[0].token_ids) for r in results],
                         "grammar_text": results[-1].outputs[0].text,
                         "vllm_accepted": accepted_by_vllm(llm) if spec else 0,
                         "stats": engine_stats(llm) if spec else {}}
        finally:
            shutdown_all([llm])
    return out


def vllm_count(llm, name: str) -> int:
    return int(sum(m.value for m in llm.get_metrics() if m.name == name))


# The step's k chosen by batch size (vLLM's num_speculative_tokens_per_batch_size):
# 2 for a batch of one, 1 above. Requests of different lengths make the
# batch shrink to one mid-way, so both ks are drafted and verified.
STEP_K_SCHEDULE = [[1, 1, 2], [2, 64, 1]]
STEP_K_TOKENS = [20, 6, 8, 4, 6]
# min_confidence 0: the tiny model's flat distributions would stop every chain.
STEP_K_SPECS = {
    "token_recycling": {"method": "token_recycling", "draft_length": "acceptance",
                        "min_confidence": 0.0},
    "token_recycling_device": {"method": "token_recycling", "tables": "device",
                               "min_confidence": 0.0},
}


# The step's k chosen by our goodput controller (bridge/v2/step_k.py), no
# schedule: it explores ks while its cost model warms up. On the device
# route the engine core chooses it.
CHOSEN_K_SPECS = {
    "token_recycling_goodput": {"method": "token_recycling", "draft_length": "goodput",
                                "min_confidence": 0.0, "num_speculative_tokens": 3},
    "token_recycling_device_goodput": {"method": "token_recycling", "tables": "device",
                                       "draft_length": "goodput", "min_confidence": 0.0,
                                       "num_speculative_tokens": 3},
}


def step_k(tmp: str) -> dict:
    from vllm import SamplingParams

    from tests.tiny_model import tiny_llama
    from vllm_plugins.bench.engines import build_engine, engine_stats, shutdown_all

    path = tiny_llama(os.path.join(tmp, "untied"))
    prompts = [{"prompt_token_ids": p} for p in tiny_prompts()]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in STEP_K_TOKENS]
    out: dict = {}
    scheduled = {name: {**spec, "num_speculative_tokens": 2,
                        "num_speculative_tokens_per_batch_size": STEP_K_SCHEDULE}
                 for name, spec in STEP_K_SPECS.items()}
    for name, spec in {"plain": None, **scheduled, **CHOSEN_K_SPECS}.items():
        llm = build_engine(path, spec, max_num_seqs=8, max_model_len=512)
        try:
            results = llm.generate(prompts, params, use_tqdm=False)
            out[name] = {"runner": runner_of(llm),
                         "tokens": [list(r.outputs[0].token_ids) for r in results]}
            if spec is not None:
                out[name].update(
                    drafts=vllm_count(llm, "vllm:spec_decode_num_drafts"),
                    draft_tokens=vllm_count(llm, "vllm:spec_decode_num_draft_tokens"),
                    accepted=vllm_count(llm, "vllm:spec_decode_num_accepted_tokens"),
                    stats=engine_stats(llm))
        finally:
            shutdown_all([llm])
    return out


# Preemption and an abort on V2: a KV cache too small for the batch (as in
# tests/test_preemption_e2e.py, smaller) makes vLLM preempt and re-prefill
# requests; one more request is aborted mid-way.
PREEMPT_KV_BYTES = 384 * 2**10
PREEMPT_TOKENS = 120
PREEMPT_SPECS = {
    "token_recycling": {"method": "token_recycling", "min_confidence": 0.0},
    "token_recycling_device": {"method": "token_recycling", "tables": "device",
                               "min_confidence": 0.0},
}


def preempted(tmp: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from tests.test_preemption_e2e import BLOCK, PROMPTS, preemptions
    from tests.tiny_model import tiny_llama
    from vllm_plugins.bench.engines import engine_stats, shutdown_all

    path = tiny_llama(os.path.join(tmp, "untied"))
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # kv_cache_memory_bytes decides
    out = {}
    for name, spec in {"plain": None, **PREEMPT_SPECS}.items():
        if spec is not None:
            spec = {**spec, "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
                    "draft_length": "fixed"}
        llm = LLM(model=path, dtype="float32", max_model_len=256, max_num_seqs=4,
                  block_size=BLOCK, kv_cache_memory_bytes=PREEMPT_KV_BYTES,
                  enforce_eager=True, seed=0, speculative_config=spec,
                  disable_log_stats=False, use_tqdm_on_load=False)
        try:
            engine = llm.llm_engine
            params = SamplingParams(temperature=0.0, max_tokens=PREEMPT_TOKENS,
                                    ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            tokens = {f"r{i}": [] for i in range(len(PROMPTS) + 1)}
            for i, prompt in enumerate(PROMPTS + PROMPTS[:1]):
                engine.add_request(f"r{i}", prompt, params)
            steps = 0
            while engine.has_unfinished_requests():
                for o in engine.step():
                    tokens[o.request_id].extend(o.outputs[0].token_ids)
                steps += 1
                if steps == 5:
                    engine.abort_request([f"r{len(PROMPTS)}"])
            out[name] = {"runner": runner_of(llm), "preemptions": preemptions(llm),
                         "tokens": [tokens[f"r{i}"] for i in range(len(PROMPTS))],
                         "stats": engine_stats(llm) if spec else {}}
        finally:
            shutdown_all([llm])
    return out


# The sampled-output check of draft probabilities on V2: one draft per
# request, drawn from the proposer's row p, verified by V2's own rejection
# sampler against the target; the output token must follow the target.
VERIFY_VOCAB = 12
VERIFY_TRIALS = 3000
VERIFY_TEMPERATURE = 0.7


def verify_rows() -> tuple:
    """(target logits before temperature, the draft rows p, their dishonest
    stand-in: uniform on p's support), fixed so the test can enumerate them."""
    import numpy as np

    gen = np.random.default_rng(5)
    target = gen.normal(0.0, 1.5, VERIFY_VOCAB)
    p = gen.dirichlet(np.full(VERIFY_VOCAB, 0.6))
    p[p < 0.02] = 0.0
    p /= p.sum()
    uniform = (p > 0) / (p > 0).sum()
    return target, p, uniform


def draft_logits(_tmp: str) -> dict:
    """V2's ``rejection_sample`` on draft rows built as the V2 drafter
    builds them (``draft_logits_block``): the honest rows, and rows that
    claim uniform while drafts are drawn from p (the control)."""
    import numpy as np
    import torch
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils import rejection_sample

    from vllm_plugins.bridge.v2.speculator import draft_logits_block

    target, p, uniform = verify_rows()
    n, T = VERIFY_TRIALS, VERIFY_TEMPERATURE
    gen = np.random.default_rng(11)
    drafts = gen.choice(VERIFY_VOCAB, size=n, p=p)
    out = {}
    for name, row in (("honest", p), ("dishonest", uniform)):
        block = draft_logits_block(drafts.reshape(n, 1), [row[None, :]] * n, [1] * n,
                                   [T] * n, VERIFY_VOCAB)
        # Two logits rows a request: its draft's, then the bonus; the
        # target's rows as V2's sampler leaves them (temperature applied).
        logits = torch.tensor(target / T, dtype=torch.float32).repeat(2 * n, 1).contiguous()
        sampled_in = torch.stack([torch.zeros(n, dtype=torch.int64),
                                  torch.from_numpy(drafts)], 1).reshape(-1)
        sampled, _num = rejection_sample(
            logits, block.contiguous(), sampled_in,
            torch.arange(0, 2 * n + 1, 2, dtype=torch.int32),
            torch.tensor([10, 11] * n, dtype=torch.int64),
            torch.arange(n, dtype=torch.int64),
            torch.arange(n, dtype=torch.int64).repeat_interleave(2),
            torch.tensor([0, 1] * n, dtype=torch.int32),
            torch.full((n,), T, dtype=torch.float32),
            torch.arange(1000, 1000 + n, dtype=torch.int64),
            1)
        first = sampled[:, 0].numpy()
        out[name] = {"counts": np.bincount(first, minlength=VERIFY_VOCAB).tolist(),
                     "accepted": int((first == drafts).sum())}
    out["target"] = (np.exp(target / T) / np.exp(target / T).sum()).tolist()
    return out


# Sampled output on V2, engine level: many seeded samples (temperature 1) of
# the first tokens after a repetitive prompt, from plain V2 and from each
# method; tests/test_v2_e2e.py compares their distributions. The tiny model,
# its vocabulary cut to 1024 tokens (one block of V2's sampling kernels,
# whose interpreted runs make most of a step's time at 49152), with an init
# whose first two tokens after the prompt are near certain (0.99, 0.95) and
# whose third is spread over a handful (0.25, 0.21, 0.12, ...): drafts are
# accepted, and the third token is where a misstated row shows.
SAMPLED_VOCAB = 1024
SAMPLED_MODEL = {"num_layers": 2, "hidden_size": 128, "num_heads": 4, "num_kv_heads": 1,
                 "intermediate_size": 256, "initializer_range": 0.4,
                 "tie_word_embeddings": True, "seed": 0}
SAMPLED_PROMPT = [1, 2, 3, 4, 5, 6] * 4
SAMPLED_N = 192
# Tokens a sample: the first from the prompt's prefill, the next two drafted.
SAMPLED_TOKENS = 3
# Requests a step; the later ones draft from what the earlier ones verified
# (STAND's store for the prompt, token recycling's table).
SAMPLED_BATCH = 96
SAMPLED_SPECS = {
    "stand": {"method": "stand", "draft_length": "fixed"},
    # min_confidence 0: drafts however flat the table's rows.
    "token_recycling": {"method": "token_recycling", "draft_length": "fixed",
                        "min_confidence": 0.0},
}
# The control: STAND drafting each distribution's mode while its row claims
# a draw from the distribution (proposers/stand_debug.py), for the requests
# that ask, on the engine that serves the honest ones too. The row misstates
# what the draft came from, and only V2's sampler reading it makes that
# bias: a draft verified as one-hot keeps the target's distribution
# whatever chose it.
STAND_DEBUG_HOOK = {"VLLM_PLUGINS_STAND_DEBUG_PROBS": "per_request"}
DISHONEST = {"stand_debug_probs": "argmax"}


def cut_vocabulary(src: str, dst: str, vocab: int) -> str:
    """A copy of the model at ``src`` keeping its first ``vocab`` tokens (rows
    of the embedding and, when untied, the output head): the same init
    with the softmax over fewer tokens. The tokenizer is copied as it is;
    the prompts and outputs here are token ids below ``vocab``."""
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    src_dir, dst_dir = Path(src), Path(dst)
    dst_dir.mkdir(parents=True, exist_ok=True)
    for f in src_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copyfile(f, dst_dir / f.name)
    for f in src_dir.glob("*.safetensors"):
        weights = load_file(f)
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in weights:
                weights[name] = weights[name][:vocab].contiguous()
        save_file(weights, dst_dir / f.name, metadata={"format": "pt"})
    config = json.loads((dst_dir / "config.json").read_text())
    config["vocab_size"] = vocab
    (dst_dir / "config.json").write_text(json.dumps(config, indent=2))
    return str(dst_dir)


def spec_counts(llm) -> dict:
    """vLLM's spec-decode counters (drafts, draft tokens, accepted)."""
    return {"drafts": vllm_count(llm, "vllm:spec_decode_num_drafts"),
            "draft_tokens": vllm_count(llm, "vllm:spec_decode_num_draft_tokens"),
            "accepted": accepted_by_vllm(llm)}


def sample_first_tokens(llm, seed0: int, extra_args=None) -> dict:
    """SAMPLED_N seeded samples of the prompt's first SAMPLED_TOKENS tokens,
    and what vLLM verified and accepted while drawing them."""
    from vllm import SamplingParams

    before = spec_counts(llm)
    params = [SamplingParams(temperature=1.0, max_tokens=SAMPLED_TOKENS, ignore_eos=True,
                             seed=seed0 + i, extra_args=extra_args)
              for i in range(SAMPLED_N)]
    results = llm.generate([{"prompt_token_ids": SAMPLED_PROMPT}] * SAMPLED_N, params,
                           use_tqdm=False)
    after = spec_counts(llm)
    return {"samples": [list(r.outputs[0].token_ids) for r in results],
            **{k: after[k] - before[k] for k in after}}


def sampled(tmp: str) -> dict:
    """Samples of plain V2, of each method on V2, and of the control."""
    from unittest import mock

    from tests.tiny_model import tiny_llama
    from vllm_plugins.bench.engines import build_engine, engine_stats, shutdown_all

    path = cut_vocabulary(tiny_llama(os.path.join(tmp, "peaked"), **SAMPLED_MODEL),
                          os.path.join(tmp, "peaked_cut"), SAMPLED_VOCAB)
    out: dict = {}
    # Each arm its own seeds: independent samples of one distribution.
    for name, seed0 in (("plain", 0), ("stand", 100_000), ("token_recycling", 200_000)):
        spec = SAMPLED_SPECS.get(name)
        if spec is not None:
            spec = {**spec, "num_speculative_tokens": SAMPLED_TOKENS - 1}
        with mock.patch.dict(os.environ, STAND_DEBUG_HOOK if name == "stand" else {}):
            llm = build_engine(path, spec, max_num_seqs=SAMPLED_BATCH, max_model_len=64)
        try:
            out[name] = {"runner": runner_of(llm), **sample_first_tokens(llm, seed0)}
            if spec is not None:
                out[name]["stats"] = engine_stats(llm)
            if name == "stand":
                out["stand_dishonest"] = {"runner": runner_of(llm),
                                          **sample_first_tokens(llm, 300_000, DISHONEST)}
        finally:
            shutdown_all([llm])
    return out


def main() -> None:
    enable()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    scenario, tmp = sys.argv[1], sys.argv[2]
    result = {"greedy": greedy, "preempted": preempted,
              "draft_logits": draft_logits, "step_k": step_k,
              "sampled": sampled}[scenario](tmp)
    print("V2_ENGINES_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
