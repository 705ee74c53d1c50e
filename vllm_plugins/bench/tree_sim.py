"""Token Recycling's acceptance with chains and trees, without a vLLM engine.

Greedy acceptance depends only on the target's greedy continuation along the
draft, and the tables learn from the target's top-k at every verified node,
so both need the real model, not the engine: this drives the proposer
(``TokenRecyclingProposer``, fixed draft length) with transformers' Llama,
verifying each step's tree in one forward (a 4D attention mask over the
cache and the step's tokens, rotary positions by depth), and reports the
mean accepted tokens per step (MAT: accepted drafts plus the target's own
token) per configuration. Batch 1, prompts in order, tables cold at the
start of each configuration and kept across its prompts, as in an engine.

    python -m vllm_plugins.bench.tree_sim --per-category 2 --max-tokens 128 \\
        --configs chain:6 best_first:16 template:80 best_first:80:nospan

A configuration is ``chain:N`` or ``BUILDER:N[:nospan]`` (BUILDER
best_first or template; ``nospan`` turns the context branch off; trees
fill their size, ``min_confidence`` 0, chains keep the default). Each
prints one line; ``--out`` appends them as JSON lines. Outputs are compared
with the first configuration's (or ``--reference``'s), token for token:
``mismatched_prompts`` counts prompts whose continuation differs. Float
rounding differs between a tree's forward and a chain's, so a near tie of
the target's top two can flip; a wrong mask or position would show on most
prompts.

A run may be split into parts (``--prompts 0:13`` then ``13:26`` with the
same ``--tables`` prefix and ``--reference`` file): each part loads the
tables the previous part saved, as one run would have them.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def parse_config(text: str) -> dict:
    parts = text.split(":")
    shape = "chain" if parts[0] == "chain" else "tree"
    opts = {"draft_length": "fixed", "draft_shape": shape}
    if shape == "tree":
        # a fixed size means that many nodes verified: no confidence cut
        opts["min_confidence"] = 0.0
        opts["tree_builder"] = parts[0]
        opts["context_branch"] = not (len(parts) > 2 and parts[2] == "nospan")
    return {"name": text, "size": int(parts[1]), "options": opts}


class TreeVerifier:
    """The target over a KV cache of committed tokens; a step's input is
    the committed tokens not yet cached (ending with the root) followed by
    the draft's nodes."""

    def __init__(self, model, topk: int):
        import torch
        from transformers import DynamicCache

        self.torch, self.model, self.topk = torch, model, topk
        self.cache = DynamicCache()
        self.cached = 0

    def step(self, pending: list[int], tokens: list[int], parents: list[int]):
        """(argmax per row, top-k ids, top-k log-probabilities); row 0 is
        the root (pending's last token), row i + 1 node i."""
        torch = self.torch
        p, n = len(pending), len(tokens)
        q = p + n
        depth = np.zeros(n, np.int64)
        for i, par in enumerate(parents):
            depth[i] = 1 if par < 0 else depth[par] + 1
        pos = np.concatenate([np.arange(p), p - 1 + depth]) + self.cached
        allowed = np.zeros((q, self.cached + q), bool)
        allowed[:, :self.cached] = True
        allowed[:, self.cached:self.cached + p] = np.tril(np.ones((q, p), bool))
        for i, par in enumerate(parents):
            row = p + i
            if par >= 0:
                allowed[row, self.cached + p:] = allowed[p + par, self.cached + p:]
            allowed[row, self.cached + row] = True
        mask = torch.zeros((1, 1, q, self.cached + q), dtype=torch.float32)
        mask[0, 0][torch.from_numpy(~allowed)] = torch.finfo(torch.float32).min
        ids = torch.tensor([pending + tokens])
        with torch.no_grad():
            out = self.model(input_ids=ids, attention_mask=mask,
                             position_ids=torch.from_numpy(pos)[None],
                             past_key_values=self.cache, use_cache=True)
        logits = out.logits[0, p - 1:].float()
        self.cache.crop(-n) if n else None
        self.cached += p
        lp = torch.log_softmax(logits, -1)
        top = torch.topk(lp, self.topk, -1)
        return (logits.argmax(-1).numpy(), top.indices.numpy().astype(np.int32),
                top.values.numpy().astype(np.float32))


def greedy_path(tokens, parents, argmax) -> list[int]:
    """Longest root-down path whose every node is the target's argmax at
    its parent's row; first sibling wins ties."""
    path, node = [], -1
    while True:
        want = argmax[node + 1]
        nxt = next((i for i, (t, par) in enumerate(zip(tokens, parents))
                    if par == node and t == want), None)
        if nxt is None:
            return path
        path.append(nxt)
        node = nxt


def run_config(model, tokenizer, prompts, config, max_tokens, vocab, tables=None,
               first=0):
    """Greedy decoding of ``prompts`` under one configuration; its tables
    start from the file ``tables`` if it exists and are saved there after."""
    import os

    from vllm_plugins.proposers.token_recycling import TokenRecyclingProposer
    from vllm_plugins.step_context import RequestStep, StepContext

    proposer = TokenRecyclingProposer(options=config["options"], vocab_size=vocab)
    if tables and os.path.exists(tables):
        proposer.tables.load(tables)
    size, eos = config["size"], tokenizer.eos_token_id
    steps = emitted = 0
    outputs, nodes = [], []
    start = time.perf_counter()
    finished: set[str] = set()
    for qi, prompt in enumerate(prompts, first):
        req = f"q{qi}"
        ver = TreeVerifier(model, proposer.TOPK)
        argmax, ids, lps = ver.step(prompt, [], [])
        out = [int(argmax[0])]
        pending = [out[0]]
        accepted, verified = list(out), [prompt[-1]]
        while True:
            ctx = StepContext([RequestStep(
                req, np.asarray(accepted, np.int64), np.asarray(prompt + out, np.int64),
                len(prompt), len(verified) - 1, np.asarray(verified, np.int64), ids, lps,
                0.0)], finished=finished, max_draft=size)
            finished = set()
            if len(out) >= max_tokens or out[-1] == eos:
                break
            drafts = proposer.step(ctx)
            tokens = drafts.tokens[0]
            parents = (drafts.parents[0] if drafts.parents and drafts.parents[0] is not None
                       else list(range(-1, len(tokens) - 1)))
            nodes.append(len(tokens))
            argmax, ids, lps = ver.step(pending, tokens, parents)
            path = greedy_path(tokens, parents, argmax)
            accepted = [tokens[i] for i in path] + [int(argmax[path[-1] + 1 if path else 0])]
            accepted = accepted[:max_tokens - len(out)]
            out += accepted
            pending = accepted
            verified = [pending_root(prompt, out, accepted)] + tokens
            steps += 1
            emitted += len(accepted)
        finished = {req}
        outputs.append(out)
    if tables:
        proposer.tables.save(tables)
    return {"config": config["name"], "prompts": len(prompts), "steps": steps,
            "tokens": emitted, "mat": emitted / max(steps, 1),
            "mean_nodes": float(np.mean(nodes)) if nodes else 0.0,
            "seconds": round(time.perf_counter() - start, 1)}, outputs


def pending_root(prompt, out, accepted) -> int:
    """The root of the step just verified: the last token before ``accepted``."""
    seq = prompt + out
    return seq[len(seq) - len(accepted) - 1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", required=True)
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    # One thread: on a shared, busy CPU two OpenMP threads wait on each
    # other far longer than they compute.
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--prompts", default=None,
                    help="START:END, a slice of the questions; with --tables, "
                         "a run in parts learns as one run would")
    ap.add_argument("--tables", default=None,
                    help="file prefix: each configuration's tables are loaded "
                         "from PREFIX.<config>.npz when it exists and saved there")
    ap.add_argument("--reference", default=None,
                    help="JSON file of outputs by prompt index: compared with, "
                         "and extended by, this run's first configuration")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from vllm_plugins.bench.data import load_questions, render
    from vllm_plugins.default_model import default_model_path

    torch.set_num_threads(args.threads)
    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32,
                                             attn_implementation="eager").eval()
    prompts = [render(tokenizer, q) for q in load_questions(per_category=args.per_category)]
    lo, hi = 0, len(prompts)
    if args.prompts:
        lo, hi = (int(x) for x in args.prompts.split(":"))
    reference = {}
    if args.reference and os.path.exists(args.reference):
        reference = json.load(open(args.reference))
    for ci, text in enumerate(args.configs):
        tables = f"{args.tables}.{text.replace(':', '_')}.npz" if args.tables else None
        result, outputs = run_config(model, tokenizer, prompts[lo:hi], parse_config(text),
                                     args.max_tokens, model.config.vocab_size, tables, lo)
        mine = {str(lo + i): out for i, out in enumerate(outputs)}
        result["prompts"] = f"{lo}:{hi}"
        result["mismatched_prompts"] = sum(mine[k] != reference[k] for k in mine
                                           if k in reference)
        if ci == 0:
            reference = {**mine, **reference}
            if args.reference:
                with open(args.reference, "w") as f:
                    json.dump(reference, f)
        print(json.dumps(result), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
