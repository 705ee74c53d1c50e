"""Sequential Monte Carlo over grammar-constrained samples (docs/grammar.md).

Each particle is an output so far and its log weight. A round extends every
unfinished particle by up to ``chunk`` tokens, one request each whose prompt
ends with the particle (vLLM's prefix cache computes nothing twice), with
AWRS weights on; the round's weights add up. When the effective number of
particles falls below half, they are resampled by weight and continue.
"""

from __future__ import annotations

import math
import random


def smc(llm, prompt_ids, grammar, n_particles=16, chunk=2, max_tokens=64,
        temperature=1.0, seed=0):
    """Returns ([(tokens, normalised weight)], log evidence): the particles
    estimate the model's distribution conditioned on the grammar, and the
    evidence estimates the chance that the model's own sample is grammatical."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random(seed)
    tokens = [[] for _ in range(n_particles)]
    log_w = [0.0] * n_particles
    done = [False] * n_particles
    while not all(done):
        live = [i for i in range(n_particles) if not done[i]]
        params = [SamplingParams(
            temperature=temperature, max_tokens=min(chunk, max_tokens - len(tokens[i])),
            extra_args={"grammar": {**grammar, "sampling": "awrs", "weights": True,
                                    "continue_tokens": tokens[i]}}) for i in live]
        prompts = [TokensPrompt(prompt_token_ids=prompt_ids + tokens[i]) for i in live]
        for i, out in zip(live, llm.generate(prompts, params, use_tqdm=False)):
            step = out.outputs[0]
            log_w[i] += out.kv_transfer_params["vllm_plugins"]["awrs_log_weight"]
            tokens[i] = tokens[i] + list(step.token_ids)
            done[i] = step.finish_reason == "stop" or len(tokens[i]) >= max_tokens
        top = max(log_w)
        w = [math.exp(x - top) for x in log_w]
        if sum(w) ** 2 / sum(x * x for x in w) < n_particles / 2:
            mean = top + math.log(sum(w) / n_particles)  # kept by every survivor
            picks = rng.choices(range(n_particles), weights=w, k=n_particles)
            tokens = [list(tokens[k]) for k in picks]
            done = [done[k] for k in picks]
            log_w = [mean] * n_particles
    top = max(log_w)
    w = [math.exp(x - top) for x in log_w]
    log_evidence = top + math.log(sum(w) / n_particles)
    return [(t, x / sum(w)) for t, x in zip(tokens, w)], log_evidence
