"""AWRS against the mask mode: constraint evaluations per token, the
grammar processor's time per step, and a token check's calls per token, on
the dev schemas.

    python -m vllm_plugins.bench grammar --awrs --schemas 16 --max-tokens 96 --batch 1 16 --vocab 262144

No engine: the default model (Hugging Face ``transformers``, float32, one
thread) gives the next-token logits, and ``GrammarLogitsProcessor`` is
driven as vLLM's V1 runner drives it, its rows sampled by vLLM's own
``Sampler`` (so temperature and the request's generator are vLLM's).
End-to-end tok/s through an engine: ``--awrs-engine``
(:mod:`vllm_plugins.bench.grammar_awrs_engine`).

* Decoding, per schema, batch 1, greedy and at temperature 1 (seeded), once
  with ``"sampling": "mask"`` and once with ``"awrs"``: the outputs
  (greedy: must be equal; seeded: equal while the prompt is prefilled in
  one step, as here) and AWRS's counts: single-token grammar checks and
  whole masks per output token. A mask evaluates the grammar on every
  vocabulary entry, so the mask mode's evaluations per token are the
  vocabulary size; AWRS's are its checks plus the vocabulary size per mask
  it fell back to.
* Time per step at each ``--batch``: the greedy mask-mode outputs are
  replayed (their logits rows, recorded while decoding) through a mask-mode,
  an AWRS and an AWRS-with-a-check processor in the same process, the order
  rotating per step; each step commits the recorded token, so all see the
  same batch, and a slot whose output ends takes the next output (the
  outputs repeated so that each slot takes about four). AWRS's evaluations
  per token are counted again here (at ``--vocab`` a mask is that many).
  Wall-clock on a shared host: the ratio is the figure to read.
* A token check (:func:`banned_words`, the banned-word example of
  docs/grammar.md, installed for the run under :data:`CHECK`): its calls per
  token in the replay. A mask would call it once per vocabulary entry.
* ``--vocab N``: the same replay on a vocabulary of N (a random tiny Llama
  from :func:`vllm_plugins.bench.vocab_cost.tiny_vocab_llama`, with the
  default model's tokenizer, so llguidance serves it; the ids past the
  tokenizer are never allowed). Its rows are the recorded ones, widened with
  values below each row's minimum: the same argmax and, at temperature 1,
  no mass on the new ids, so each step decides as at the default vocabulary
  and only the width differs. (The tiny model's own rows would not do: a
  random model mostly repeats its last token, which the grammar refuses, so
  AWRS would fall back to the mask at most steps.)
"""

from __future__ import annotations

import importlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

#: How each processor's requests ask for their grammar (besides the schema).
CHECK = "vllm_plugins_bench_banned_words"
MODES = {"mask": {"sampling": "mask"}, "awrs": {"sampling": "awrs"},
         "awrs+check": {"sampling": "awrs", "check": CHECK}}
_DECODE = ("mask", "awrs")
BANNED = ("bad", "word")


def banned_words(text: str, token: str) -> bool:
    """No banned word anywhere in the output: the text with the token may
    not contain one (one spanning the boundary counts)."""
    tail = text[-max(map(len, BANNED)):] + token
    return not any(w in tail for w in BANNED)


def install_check() -> str:
    """Register :func:`banned_words` as :data:`CHECK` in the entry-point
    group checks are found by, as another package's wheel would, for this
    process (a distribution folder in a temporary path on ``sys.path``)."""
    from vllm_plugins.grammar.checks import ENTRY_POINT_GROUP, available

    if CHECK in available():
        return CHECK
    where = Path(tempfile.mkdtemp(prefix="vllm_plugins_bench_checks_"))
    dist = where / "vllm_plugins_bench_checks-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-plugins-bench-checks\n"
                                   "Version: 1.0\n")
    (dist / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\n{CHECK} = {__name__}:banned_words\n")
    sys.path.insert(0, str(where))
    importlib.invalidate_caches()
    return CHECK


def _sampling_params(schema, mode: str, temperature: float, seed, max_tokens: int, eos: int):
    from vllm import SamplingParams

    p = SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                       extra_args={"grammar": {"json_schema": schema, **MODES[mode]}})
    p.update_from_generation_config({}, eos)
    return p
def _metadata(proc, plist, generators, vocab: int):
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    temps = [0.0 if p.temperature < 1e-5 else p.temperature for p in plist]
    n = len(plist)
    return SamplingMetadata(
        temperature=torch.tensor(temps, dtype=torch.float32),
        all_greedy=all(t == 0.0 for t in temps), all_random=all(t > 0 for t in temps),
        top_p=None, top_k=None, generators=generators, max_num_logprobs=None,
        no_penalties=True, prompt_token_ids=None, frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors([proc]))


def prefill(model, prompt: list[int]):
    """The prompt's last logits row and KV cache, computed once per prompt
    and shared by its decodings (:func:`decode` copies the cache)."""
    import torch

    with torch.no_grad():
        res = model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
    return res.logits[0, -1].clone(), res.past_key_values


def decode(model, proc, prompt: list[int], params, vocab: int, prefix):
    """One request decoded through the processor and vLLM's Sampler, from
    ``prefix`` (:func:`prefill` of ``prompt``): its tokens and the logits row
    of every step."""
    import copy

    import torch
    from vllm.v1.sample.logits_processor import BatchUpdate
    from vllm.v1.sample.sampler import Sampler

    out: list[int] = []
    proc.update_state(BatchUpdate(1, [], [(0, params, prompt, out)], []))
    gens = {} if params.seed is None else {0: torch.Generator().manual_seed(params.seed)}
    sampler, rows = Sampler(), []
    last, past = prefix[0], copy.deepcopy(prefix[1])
    with torch.no_grad():
        for step in range(params.max_tokens):
            if step:
                res = model(torch.tensor([[out[-1]]]), past_key_values=past, use_cache=True)
                past, last = res.past_key_values, res.logits[0, -1]
            row = last[:vocab].float()
            rows.append(row.clone())
            proc.update_state(None)
            tok = int(sampler(row[None].clone(), _metadata(proc, [params], gens, vocab))
                      .sampled_token_ids[0, 0])
            out.append(tok)
            if tok == params.eos_token_id:
                break
    proc.update_state(BatchUpdate(0, [0], [], []))
    return out, rows


def _plain_metadata(n: int, temperature: float):
    """vLLM's sampling metadata for n unseeded rows at one temperature, no
    logits processors (they ran already)."""
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    greedy = temperature < 1e-5
    return SamplingMetadata(
        temperature=torch.full((n,), 0.0 if greedy else temperature), all_greedy=greedy,
        all_random=not greedy, top_p=None, top_k=None, generators={}, max_num_logprobs=None,
        no_penalties=True, prompt_token_ids=None, frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors([]))


def replay_times(procs: dict, seqs: list, batch: int, eos: int, temperature: float,
                 width: int | None = None):
    """Per-step processor time of each mode over the recorded outputs
    (schema, prompt, tokens, rows), ``batch`` at a time: a slot whose output
    ends takes the next one, as continuous batching refills it; steps while
    every slot is busy. The order of the modes rotates per step. ``width``:
    the rows widened to it with values below each row's minimum (built
    outside the timed calls)."""
    import torch
    from vllm.v1.sample.logits_processor import BatchUpdate
    from vllm.v1.sample.sampler import Sampler

    times = {m: [] for m in procs}
    queue = list(seqs)
    slots: list = [None] * batch
    outs = {m: [None] * batch for m in procs}
    pad = None
    if width is not None:
        pad = torch.rand(width - seqs[0][3][0].shape[0], generator=torch.Generator().manual_seed(0))

    def fill(slot: int) -> bool:
        if not queue:
            return False
        s, p, t, rows = queue.pop(0)
        removed = [] if slots[slot] is None else [slot]
        slots[slot] = [t, rows, 0]
        for m, proc in procs.items():
            outs[m][slot] = []
            sp = _sampling_params(s, m, temperature, None, len(t), eos)
            proc.update_state(BatchUpdate(batch, removed, [(slot, sp, p, outs[m][slot])], []))
        return True

    if not all(fill(i) for i in range(batch)):
        return times
    names = list(procs)
    while True:
        logits = torch.stack([rows[k] for _, rows, k in slots])
        if pad is not None:
            low = logits.min(dim=1, keepdim=True).values - 1.0
            logits = torch.cat([logits, low - pad[None]], dim=1)
        step = len(times[names[0]])
        for m in names[step % len(names):] + names[:step % len(names)]:
            procs[m].update_state(None)
            x = logits.clone()
            procs[m].awrs_defer = True  # as the model runner's _sample tells it
            t0 = time.perf_counter()
            procs[m].apply(x)
            elapsed = time.perf_counter() - t0
            if procs[m].awrs_deferred_rows:
                # AWRS rows left to vLLM's draw: the sampler (not timed: both
                # modes pay it), then the processor's check of what it drew.
                sampled = Sampler()(x, _plain_metadata(batch, temperature)).sampled_token_ids
                t0 = time.perf_counter()
                procs[m].awrs_after_sample(sampled)
                elapsed += time.perf_counter() - t0
            times[m].append(elapsed * 1e3)
        for i, slot in enumerate(slots):
            for m in procs:
                outs[m][i].append(slot[0][slot[2]])
            slot[2] += 1
        if any(slot[2] == len(slot[0]) and not fill(i) for i, slot in enumerate(slots)):
            break
    for m, proc in procs.items():
        proc.update_state(BatchUpdate(0, list(range(batch))[::-1], [], []))
    return times


def tiny_config(vocab: int, tokenizer: str):
    """The engine config of a random tiny Llama with a ``vocab``-wide
    vocabulary (written once to a temporary folder) and ``tokenizer``."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_plugins.bench.vocab_cost import tiny_vocab_llama

    path = tiny_vocab_llama(Path(tempfile.gettempdir()) / f"vllm_plugins_awrs_vocab_{vocab}",
                            vocab)
    return EngineArgs(model=path, tokenizer=tokenizer, max_model_len=1024, enforce_eager=True,
                      dtype="float32").create_engine_config()


def print_replay(procs: dict, recorded: list, batches: list[int], eos: int, vocab: int,
                 width: int | None) -> None:
    """The replay's rows of the time table, one per batch and decoding."""
    check, awrs = procs["awrs+check"].awrs_stats, procs["awrs"].awrs_stats
    n = width or vocab
    for batch in batches:
        for temperature, label in ((0.0, "greedy"), (1.0, "temperature 1")):
            rows0, calls0 = check.rows, check.check_calls
            before = (awrs.rows, awrs.checks, awrs.masks)
            reps = max(1, -(-4 * batch // len(recorded)))  # 4 outputs a slot
            times = replay_times(procs, recorded * reps, batch, eos, temperature, width)
            mk, aw, ck = times["mask"], times["awrs"], times["awrs+check"]
            if not mk:
                print(f"| {n} | {batch} | {label} | 0 ||||||||")
                continue
            rows, checks, masks = (a - b for a, b in zip(
                (awrs.rows, awrs.checks, awrs.masks), before))
            c_rows, calls = check.rows - rows0, check.check_calls - calls0
            mean = statistics.fmean
            print(f"| {n} | {batch} | {label} | {len(mk)} | "
                  f"{(checks + masks * n) / max(rows, 1):.0f} | "
                  f"{statistics.median(mk):.3f} ({mean(mk):.3f}) | "
                  f"{statistics.median(aw):.3f} ({mean(aw):.3f}) | {mean(aw) / mean(mk):.2f} | "
                  f"{mean(ck):.3f} | {calls / max(c_rows, 1):.2f} | {n} |", flush=True)


def run_awrs(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm.engine.arg_utils import EngineArgs

    from vllm_plugins.bench.engines import resolve_model
    from vllm_plugins.bench.grammar_bench import load_schemas, prompt_ids
    from vllm_plugins.grammar.spec import GrammarSpecError, compile_grammar_request
    from vllm_plugins.logits_processors.grammar import GrammarLogitsProcessor

    torch.set_num_threads(max(args.threads, 1))
    install_check()
    model_path = resolve_model(args.model)
    cfg = EngineArgs(model=model_path, max_model_len=args.max_model_len, enforce_eager=True,
                     dtype="float32").create_engine_config()
    vocab = cfg.model_config.get_vocab_size()
    if args.vocab is not None and args.vocab < vocab:
        raise SystemExit(f"--vocab {args.vocab} is below the model's vocabulary ({vocab})")
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    eos = tok.eos_token_id
    schemas = []
    for row in load_schemas(args.schemas, args.schema_file):
        try:
            compile_grammar_request({"json_schema": row["schema"]})
            schemas.append(row["schema"])
        except GrammarSpecError:
            continue
    procs = {m: GrammarLogitsProcessor(cfg, torch.device("cpu"), False) for m in MODES}
    print(f"model {model_path}, vocab {vocab}, schemas {len(schemas)}, "
          f"max tokens {args.max_tokens}, torch threads {torch.get_num_threads()}\n")
    print("| decoding | tokens | outputs equal to mask mode | checks / token | "
          "masks / token | evaluations / token, AWRS | mask mode | ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
    recorded = []
    prompts = [prompt_ids(tok, schema) for schema in schemas]
    prefixes = [prefill(model, prompt) for prompt in prompts]
    for temperature, label in ((0.0, "greedy"), (1.0, "temperature 1, seeded")):
        stats = procs["awrs"].awrs_stats
        before = (stats.rows, stats.checks, stats.masks)
        equal = n_tokens = 0
        for k, (schema, prompt) in enumerate(zip(schemas, prompts)):
            seed = None if temperature == 0.0 else args.seed + k
            got = {}
            for m in _DECODE:
                p = _sampling_params(schema, m, temperature, seed, args.max_tokens, eos)
                got[m] = decode(model, procs[m], prompt, p, vocab, prefixes[k])
            equal += got["awrs"][0] == got["mask"][0]
            n_tokens += len(got["awrs"][0])
            if temperature == 0.0:
                recorded.append((schema, prompt, got["mask"][0], got["mask"][1]))
        rows, checks, masks = (a - b for a, b in zip(
            (stats.rows, stats.checks, stats.masks), before))
        per_tok = (checks + masks * vocab) / max(rows, 1)
        print(f"| {label} | {n_tokens} | {equal}/{len(schemas)} | {checks / max(rows, 1):.2f} | "
              f"{masks / max(rows, 1):.3f} | {per_tok:.0f} | {vocab} | "
              f"{vocab / max(per_tok, 1e-9):.0f}x |", flush=True)
    del model, prefixes
    print("\n| vocab | batch | decoding | steps | evaluations / token, AWRS | "
          "mask ms a step, p50 (mean) | AWRS | AWRS / mask (mean) | AWRS + check (mean) | "
          "check calls / token, AWRS | mask mode |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
          flush=True)
    print_replay(procs, recorded, args.batch, eos, vocab, None)
    if args.vocab is not None:
        big = tiny_config(args.vocab, model_path)
        procs = {m: GrammarLogitsProcessor(big, torch.device("cpu"), False) for m in MODES}
        print_replay(procs, recorded, args.batch, eos, vocab, args.vocab)
    return 0
