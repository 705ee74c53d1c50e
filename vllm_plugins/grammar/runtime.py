"""llguidance matchers and token bitmasks for a batch of logits rows.

Shared by both vLLM logits-processor interfaces of
``logits_processors.grammar``, the grammar-forced draft proposer (tokenizer
and matchers only) and the grammar benchmark. Nothing here knows about
vLLM's batch bookkeeping: callers hand over (row, matcher) pairs and a
logits tensor.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import llguidance
import llguidance.torch as llg_torch
import numpy as np
import torch

from .compile_cache import OnceCache, on_deep_stack
from .spec import CompiledGrammar

logger = logging.getLogger(__name__)

def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# Masks are filled on llguidance's thread pool only for batches this large and
# with this many cores (vLLM's own guidance backend uses 16 too); below that the
# pool's hand-off costs more than it saves.
PARALLEL_FILL_MIN_ROWS = 16
PARALLEL_FILL_MIN_CORES = 4

# Matcher templates by grammar text: a request gets a deep copy of a compiled
# matcher, far cheaper than compiling its grammar again.
_TEMPLATE_CACHE_SIZE = 256
# Runtimes by (tokenizer, revision, logits width): one per engine model.
_RUNTIME_CACHE_SIZE = 8


def build_ll_tokenizer(tokenizer, vocab_size: int | None = None) -> llguidance.LLTokenizer:
    """An ``LLTokenizer`` for a Hugging Face fast tokenizer (what vLLM loads).

    ``vocab_size`` is the model's logits width when it is larger than the
    tokenizer (padded embeddings); the extra ids are never allowed.
    """
    import llguidance.hf

    n_vocab = max(vocab_size or 0, len(tokenizer))
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab)


@dataclass
class GrammarRuntime:
    """Per-process llguidance state: tokenizer, matcher templates, bitmask buffer."""

    ll_tokenizer: llguidance.LLTokenizer
    num_threads: int = field(default_factory=lambda: max(1, min(8, _cores() // 2)))

    def __post_init__(self) -> None:
        self.vocab_size = self.ll_tokenizer.vocab_size
        self.eos_token = self.ll_tokenizer.eos_token
        # Shared with the engine core's compile pool (compile_cache): a template
        # being compiled there is awaited here, never compiled twice.
        self._templates = OnceCache(_TEMPLATE_CACHE_SIZE)
        self._bitmask = llg_torch.allocate_token_bitmask(1, self.vocab_size)
        self._executor: llguidance.LLExecutor | None = None
        self._parallel = _cores() >= PARALLEL_FILL_MIN_CORES
        self._shifts: dict[torch.device, torch.Tensor] = {}

    # ---- matchers -------------------------------------------------------
    def template(self, compiled: CompiledGrammar) -> llguidance.LLMatcher:
        """The compiled matcher for ``compiled``'s grammar text (compiled once
        per process; never advanced: requests get copies)."""
        return self._templates.get(compiled.grammar, lambda: on_deep_stack(
            lambda: llguidance.LLMatcher(
                self.ll_tokenizer,
                compiled.grammar,
                log_level=int(os.environ.get("LLGUIDANCE_LOG_LEVEL", "0")),
            )))

    def new_matcher(self, compiled: CompiledGrammar) -> llguidance.LLMatcher:
        return self.template(compiled).deep_copy()

    # ---- bitmask --------------------------------------------------------
    def bitmask(self, num_rows: int) -> torch.Tensor:
        """A CPU int32 [num_rows, ceil(vocab/32)] buffer (grown, never shrunk)."""
        if self._bitmask.shape[0] < num_rows:
            self._bitmask = llg_torch.allocate_token_bitmask(
                max(num_rows, 2 * self._bitmask.shape[0]), self.vocab_size
            )
        return self._bitmask

    def fill(self, pairs: list[tuple[llguidance.LLMatcher, int]], num_rows: int) -> torch.Tensor:
        """Fill bitmask row ``r`` with matcher ``m``'s next-token mask, for each (m, r).

        A stopped or failed matcher yields a mask with only llguidance's EOS bit.
        """
        bitmask = self.bitmask(num_rows)
        if len(pairs) < PARALLEL_FILL_MIN_ROWS or not self._parallel:
            for matcher, row in pairs:
                llg_torch.fill_next_token_bitmask(matcher, bitmask, row)
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor(num_threads=self.num_threads)
            llg_torch.fill_next_token_bitmask_par(self._executor, pairs, bitmask)
        return bitmask

    def apply(self, logits: torch.Tensor, rows: list[int], bitmask_rows: list[int]) -> None:
        """``logits[rows[i]]`` keeps only the tokens set in ``bitmask[bitmask_rows[i]]``."""
        if not rows:
            return
        width = logits.shape[1]
        words = self._bitmask[bitmask_rows]  # [n, W] int32, CPU (advanced index: a copy)
        banned = self.banned_tokens(words, width, logits.device)
        if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
            logits.masked_fill_(banned, float("-inf"))
        else:
            index = torch.tensor(rows, device=logits.device)
            sub = logits.index_select(0, index)
            sub.masked_fill_(banned, float("-inf"))
            logits.index_copy_(0, index, sub)

    def banned_tokens(self, words: torch.Tensor, width: int, device: torch.device,
                      use_numpy: bool | None = None) -> torch.Tensor:
        """Bool [n, width] on ``device``: True where bitmask ``words`` forbids the token."""
        n = words.shape[0]
        if use_numpy if use_numpy is not None else device.type == "cpu":
            # Bits of an int32 word, lowest first, are tokens 32*w .. 32*w+31;
            # little-endian bytes + bitorder="little" give exactly that order.
            # Unpacking the inverted words yields the *disallowed* tokens as 0/1
            # bytes, viewed as bool without a copy.
            bits = np.unpackbits((~words.numpy()).view(np.uint8), axis=1, bitorder="little")
            banned = torch.from_numpy(bits[:, :width]).view(torch.bool).to(device)
        else:
            shifts = self._shifts.get(device)
            if shifts is None:
                shifts = self._shifts[device] = torch.arange(32, dtype=torch.int32, device=device)
            w = words.to(device, non_blocking=True)
            banned = ((w.unsqueeze(-1) >> shifts) & 1).view(n, -1)[:, :width] == 0
        if banned.shape[1] < width:  # logits wider than the tokenizer: never allowed
            pad = torch.ones((n, width - banned.shape[1]), dtype=torch.bool, device=device)
            banned = torch.cat([banned, pad], dim=1)
        return banned

    @staticmethod
    def force_token(logits: torch.Tensor, rows: list[int], token_ids: list[int]) -> None:
        """Make ``token_ids[i]`` the only possible token of ``logits[rows[i]]``."""
        if not rows:
            return
        index = torch.tensor(rows, device=logits.device)
        toks = torch.tensor(token_ids, device=logits.device)
        logits.index_fill_(0, index, float("-inf"))
        logits[index, toks] = 0.0


_RUNTIMES = OnceCache(_RUNTIME_CACHE_SIZE)


def runtime_for(tokenizer, vocab_size: int | None, key: tuple) -> GrammarRuntime:
    """One runtime per (tokenizer, vocab) in this process: building one reads
    the whole vocabulary, so it is done once (a caller that finds it being
    built on the compile pool waits for it)."""
    return _RUNTIMES.get(key, lambda: GrammarRuntime(build_ll_tokenizer(tokenizer, vocab_size)))


def engine_runtime_key(model_config) -> tuple:
    """The runtime key of an engine's model: the grammar logits processor
    and the engine core's compile hold must find the same runtime."""
    return (model_config.tokenizer, model_config.tokenizer_revision,
            model_config.get_vocab_size())


def engine_runtime(model_config) -> GrammarRuntime:
    """The runtime for an engine's model, its tokenizer loaded as vLLM loads it."""
    key = engine_runtime_key(model_config)
    fut = _RUNTIMES.peek(key)
    if fut is not None and fut.done() and fut.exception() is None:
        return fut.result()
    from vllm.tokenizers import cached_tokenizer_from_config

    tokenizer = cached_tokenizer_from_config(model_config)
    if tokenizer is None:
        raise RuntimeError("the engine was started with skip_tokenizer_init")
    return runtime_for(tokenizer, model_config.get_vocab_size(), key)
