"""The draws behind ``"sampling": "awrs"``: vLLM's own race for greedy and
seeded rows, an inverse-CDF draw for unseeded ones.

Why two: a seeded request must give the mask mode's very tokens, so its
row replays the noise vLLM's sampler draws from the request's generator (a
vocabulary-wide pass of noise, as costly as vLLM's own draw). An unseeded
row only needs the mask mode's distribution: exp over the row, block sums,
a uniform and two short searches find the token; a refusal takes the
token's mass out of its block and draws again. Both take refused tokens out
and draw again, so the first allowed token is distributed as the masked
row's (for the race, it is the masked race's winner for the same noise).

On the CPU the rows are read through numpy, into buffers kept between
steps: numpy's reductions over one row take microseconds where torch's
take tens, and fresh vocabulary-sized tensors fault in new pages each step.
"""

from __future__ import annotations

import numpy as np
import torch

#: Tokens per block of the inverse-CDF search.
BLOCK = 256


def race(work: torch.Tensor, noise: torch.Tensor | None) -> int:
    """vLLM's draw from the (processed, masked) row ``work``: its greedy
    argmax without noise, else the race winner for ``noise``."""
    from vllm.v1.sample.sampler import Sampler

    if noise is None:
        if work.device.type == "cpu":  # the same index (argmax_rows), far faster
            return int(work.detach().float().numpy().argmax())
        return int(Sampler.greedy_sample(work[None])[0])
    if noise.dtype == torch.long:  # CPU: Gumbel noise from a seed
        return int(torch.ops._C.fused_gumbel_argmax(work[None], noise)[0])
    probs = work.softmax(-1, dtype=torch.float32)
    return int(probs.div_(noise).argmax())


def argmax_rows(logits: torch.Tensor, rows: list[int]) -> list[int]:
    """vLLM's greedy token of each of ``logits[rows]``: the first maximum,
    the first NaN (as its ``greedy_argmax`` and ``argmax``; pinned in
    tests/test_awrs.py). On the CPU numpy's argmax, ~3 us a row."""
    if not rows:
        return []
    if logits.device.type == "cpu":
        table = logits.detach().numpy()
        return [int(table[r].argmax()) for r in rows]
    from vllm.v1.sample.sampler import Sampler

    return Sampler.greedy_sample(logits[rows]).tolist()


_BUFFERS: dict[tuple[int, str], np.ndarray] = {}


def _buffer(n: int, width: int, use: str) -> np.ndarray:
    """A float32 [n, width] scratch array, reused between steps: one per
    ``use`` (the step's rows; a single row drawn meanwhile; a row copy)."""
    buf = _BUFFERS.get((width, use))
    if buf is None or buf.shape[0] < n:
        buf = _BUFFERS[(width, use)] = np.empty((max(n, 16), width), dtype=np.float32)
    return buf[:n]


def scratch_copy(row: torch.Tensor) -> torch.Tensor:
    """A copy of a CPU row in a buffer kept between calls (valid until the
    next call): a fresh vocabulary-sized tensor faults in new pages."""
    if row.device.type != "cpu":
        return row.clone()
    buf = _buffer(1, row.shape[0], "copy")[0]
    np.copyto(buf, row.detach().float().numpy())
    return torch.from_numpy(buf)


class Uniforms:
    """Uniform floats in [0, 1) from torch's global generator, taken a block
    at a time: every rank draws the same ones (vLLM seeds torch alike on all
    ranks), and one call costs several microseconds where a float from the
    block costs nothing."""

    __slots__ = ("_left",)
    _BLOCK = 8

    def __init__(self) -> None:
        self._left: list[float] = []

    def random(self) -> float:
        if not self._left:
            self._left = torch.rand(self._BLOCK, dtype=torch.float64).tolist()
        return self._left.pop()


def row_weights(logits: torch.Tensor, rows: list[int], temperatures: list[float],
                use: str = "rows") -> list["CdfDraw"]:
    """An inverse-CDF draw for each of ``logits[rows]`` at its temperature:
    exp((row - max) / T) and its block sums, in one pass over the step's
    rows. The draws read a buffer the next call overwrites."""
    v = logits.shape[1]
    width = -(-v // BLOCK) * BLOCK
    buf = _buffer(len(rows), width, use)
    if logits.device.type == "cpu":
        table = logits.detach().float().numpy()
    else:  # only the rows drawn from cross to the host
        table, rows = logits[rows].detach().float().cpu().numpy(), range(len(rows))
    for i, (r, t) in enumerate(zip(rows, temperatures)):
        row = table[r]
        np.subtract(row, row.max(), out=buf[i, :v])
        if t != 1.0:
            np.multiply(buf[i, :v], np.float32(1.0 / t), out=buf[i, :v])
    buf[:, v:] = -np.inf  # the padding: weight 0
    np.exp(buf, out=buf)
    sums = block_sums(buf)
    rng = Uniforms()
    return [CdfDraw(buf[i], sums[i], rng) for i in range(len(rows))]


def block_sums(weights: np.ndarray) -> np.ndarray:
    """float64 [n, width / BLOCK]: the sums of each row's blocks of
    :data:`BLOCK` weights (one matrix-vector product: numpy's reduction along
    an axis costs several times more)."""
    ones = _BUFFERS.get((BLOCK, "ones"))
    if ones is None:
        ones = _BUFFERS[(BLOCK, "ones")] = np.ones(BLOCK, dtype=np.float32)
    n = weights.shape[0]
    return (weights.reshape(-1, BLOCK) @ ones).reshape(n, -1).astype(np.float64)


def row_draw(scaled: torch.Tensor) -> "CdfDraw":
    """An inverse-CDF draw from one temperature-scaled row (any device)."""
    return row_weights(scaled[None], [0], [1.0], use="single")[0]


class CdfDraw:
    """Draws from one row's unnormalised weights without replacement: a
    uniform times the remaining mass, searched over block sums, then within
    the block. The weights and sums are this object's to change (refused
    tokens are zeroed)."""

    __slots__ = ("weights", "blocks", "total", "initial", "rng")

    def __init__(self, weights: np.ndarray, blocks: np.ndarray,
                 rng: Uniforms | None = None) -> None:
        self.weights = weights
        self.blocks = blocks
        self.total = float(blocks.sum())
        self.initial = self.total
        self.rng = rng

    def _uniform(self) -> float:
        if self.rng is None:
            self.rng = Uniforms()
        return self.rng.random()

    def draw(self) -> int | None:
        """A token with chance weight / remaining mass; None: none is left."""
        if self.total <= 0.0:
            return None
        tok = (_search or warm_up())(self.weights, self.blocks, self._uniform() * self.total)
        return None if tok < 0 else tok

    def p(self, tok: int) -> float:
        """The token's share of the whole row (0 once removed)."""
        return float(self.weights[tok]) / self.initial

    def remove(self, tok: int) -> float:
        """Take ``tok`` out of the draws; returns its weight."""
        w = float(self.weights[tok])
        if w > 0.0:
            self.weights[tok] = 0.0
            self.blocks[tok // BLOCK] = max(self.blocks[tok // BLOCK] - w, 0.0)
            self.total = max(self.total - w, 0.0)
        return w

    def restore(self, tok: int, w: float) -> None:
        """Undo :meth:`remove` (a token taken out for the weight's second draw)."""
        if w > 0.0:
            self.weights[tok] = w
            self.blocks[tok // BLOCK] += w
            self.total += w


_search = None  # _cdf_index compiled, once warm_up ran


def warm_up():
    """The draw's search, compiled (or loaded from numba's cache). Called when
    a process's first AWRS request is added: that one step waits for it
    (numba's import alone takes half a second here), where a call at
    processor construction would delay every engine start."""
    global _search
    if _search is None:
        from vllm_plugins.proposers.jit import cached_njit

        fn = cached_njit(_cdf_index)
        fn(np.ones(BLOCK, dtype=np.float32), np.ones(1), 0.5)
        _search = fn
    return _search


def _cdf_index(weights: np.ndarray, blocks: np.ndarray, u: float) -> int:
    """The first token whose running sum of weights passes ``u``: the block
    first, then within it (-1: no weight left). Rounding between the block
    sums and the weights can carry ``u`` past a block's end: its last token
    with weight then."""
    chosen, before, acc = -1, 0.0, 0.0
    for b in range(blocks.shape[0]):
        s = blocks[b]
        if s > 0.0:
            chosen, before = b, acc
            if acc + s > u:
                break
        acc += s
    if chosen < 0:
        return -1
    u -= before
    last, run = -1, 0.0
    for i in range(chosen * BLOCK, (chosen + 1) * BLOCK):
        w = weights[i]
        if w > 0.0:
            last = i
            run += w
            if run > u:
                return i
    return last
