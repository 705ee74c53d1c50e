"""The target model's own layers as a drafter, inside vLLM's paged KV cache.

Layer-skip (SWIFT) and early-exit (DEL) self-speculation draft with the
target's weights: no copy, no second model. ``TargetLayers`` is the one
place that runs those partial forwards, so it is the one place that builds
vLLM attention metadata and forward contexts outside vLLM's runner; the
bridge hands it to a self-drafting proposer as ``StepContext.target``
(``bridge/v1/step.py``). Each vLLM function it relies on is named where it is
used and pinned in tests/test_bridge_pins.py. The plan and result types the
proposers use are vLLM-free (``vllm_plugins.self_draft``).

KV for drafted positions. The drafter writes the K/V of the layers it runs at
the draft positions' own slots: positions the next verification step
recomputes and overwrites (vLLM's EAGLE does the same). The scheduler reserves
those slots because the bridge raises ``VllmConfig.num_lookahead_tokens`` to
``num_speculative_tokens`` for methods that draft this way: the memory cost is
at most ``num_speculative_tokens`` extra KV slots per running request inside
the existing cache, no scratch area. Positions the target already committed
are never written: scoring passes over recent context (``score``) run with no
KV writes at all and read the target's own K/V.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from vllm_plugins.self_draft import SECONDS, DraftRows, LayerPlan, SelfDraftResult


def check_target(runner, method: str) -> None:
    """Refuses, at start-up, a target whose attention layers do not share
    one attention group.

    ``TargetLayers`` builds one attention metadata for every layer; a model
    mixing sliding-window and full attention has several groups and would
    fail at its first decode. GPUModelRunner.get_kv_cache_spec() gives each
    attention layer's KV-cache spec, the grouping vLLM itself uses. (The
    decoder's shape is checked by the proposer's ``load_model``.)
    """
    model = runner.get_model()
    specs = list(runner.get_kv_cache_spec().values())
    kinds = []
    for spec in specs:
        if spec not in kinds:
            kinds.append(spec)
    if len(kinds) > 1:
        names = sorted({type(k).__name__ for k in kinds})
        raise ValueError(
            f"speculative method '{method}' drafts with one attention metadata "
            f"for every layer, but {type(model).__name__} has {len(kinds)} kinds "
            f"of attention layers ({', '.join(names)}: e.g. sliding-window beside "
            "full attention); use a method that does not run the target's layers")


class TargetLayers:
    """Partial forwards of the loaded target for one step of one runner."""

    def __init__(self, runner, block_table: torch.Tensor):
        # GPUModelRunner.get_model() unwraps CUDA-graph / ubatch wrappers.
        self.runner = runner
        self.model = runner.get_model()
        inner = self.model.model  # LlamaModel-like: embed_input_ids, layers, norm
        self.inner = inner
        self.layers = list(inner.layers)[inner.start_layer:inner.end_layer]
        self.num_layers = len(self.layers)
        # runner.attn_groups[kv_cache_group][attn_group]: AttentionGroup with
        # layer_names and build_metadata(common_attn_metadata).
        groups = [g for gs in runner.attn_groups for g in gs]
        if len(groups) != 1:
            raise RuntimeError(
                "self-speculation supports models with one attention group; "
                f"this model has {len(groups)}")
        self.group = groups[0]
        self.layer_names = list(self.group.layer_names)
        self.block_table = block_table
        # InputBatch.block_table[group].block_size: the size slot ids use.
        self.block_size = int(runner.input_batch.block_table[0].block_size)
        self.device = runner.device
        self.vocab_size = int(runner.input_batch.vocab_size)

    # ------------------------------------------------------------- metadata
    def _metadata(self, rows: torch.Tensor, query_lens: torch.Tensor,
                  seq_lens: torch.Tensor, positions: torch.Tensor, write_kv: bool):
        from vllm.v1.attention.backend import CommonAttentionMetadata

        num_reqs = int(rows.numel())
        qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(query_lens.to(torch.int32), 0)
        block_table = self.block_table[rows.to(self.block_table.device)]
        req_of_token = torch.repeat_interleave(
            torch.arange(num_reqs), query_lens.to(torch.int64))
        pos = positions.to(torch.int64)
        blocks = block_table.to("cpu")[req_of_token, pos // self.block_size]
        slots = blocks.to(torch.int64) * self.block_size + pos % self.block_size
        cam = CommonAttentionMetadata(
            query_start_loc=qsl.to(self.device),
            query_start_loc_cpu=qsl,
            seq_lens=seq_lens.to(torch.int32).to(self.device),
            num_reqs=num_reqs,
            num_actual_tokens=int(pos.numel()),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            block_table_tensor=block_table,
            slot_mapping=slots.to(self.device),
            positions=pos.to(self.device),
            seq_lens_cpu_upper_bound=seq_lens.to(torch.int32),
        )
        md = self.group.build_metadata(cam)
        attn_metadata = {name: md for name in self.layer_names}
        slot_mapping = ({name: cam.slot_mapping for name in self.layer_names}
                        if write_kv else {})
        return attn_metadata, slot_mapping

    # -------------------------------------------------------------- forward
    @torch.inference_mode()
    def _forward(self, token_ids: torch.Tensor, positions: torch.Tensor,
                 plan: LayerPlan, attn_metadata, slot_mapping,
                 capture: tuple[int, ...] = ()):
        """Final hidden (after the model's norm) and captured streams.

        ``capture``: layer indices whose residual stream *entering* that layer
        is returned (index == num layers: the stream after the last run layer).
        """
        # vllm.forward_context.set_forward_context(attn_metadata, vllm_config,
        #     num_tokens=..., slot_mapping=...): Attention layers read their
        # metadata and slot mapping from it (unified_kv_cache_update and
        # unified_attention_with_output).
        from vllm.forward_context import set_forward_context

        captured = {}
        with set_forward_context(attn_metadata, self.runner.vllm_config,
                                 num_tokens=int(token_ids.numel()),
                                 slot_mapping=slot_mapping):
            stream = self.inner.embed_input_ids(token_ids)
            for i in range(plan.depth):
                if i in capture:
                    captured[i] = stream
                layer = self.layers[i]
                if plan.attn[i]:
                    stream = stream + layer.self_attn(
                        positions=positions,
                        hidden_states=layer.input_layernorm(stream))
                if plan.mlp[i]:
                    stream = stream + layer.mlp(layer.post_attention_layernorm(stream))
            if plan.depth in capture:
                captured[plan.depth] = stream
            hidden = self.inner.norm(stream)
        return hidden, captured

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def head_of_stream(self, stream: torch.Tensor) -> torch.Tensor:
        """Logits of an early exit: the shared final norm and LM head."""
        with torch.inference_mode():
            return self.model.compute_logits(self.inner.norm(stream))

    # ---------------------------------------------------------------- draft
    def draft(self, req: DraftRows, steps: int, plan: LayerPlan,
              stop_below: float = 0.0, head=None,
              max_lengths: np.ndarray | None = None) -> SelfDraftResult:
        """Greedy drafts, ``steps`` per request, writing the run layers' K/V at
        the draft positions (recomputed by the next verification).
        ``head`` maps final hidden states to (logits, token ids of the logit
        columns or None for the full vocabulary); default: the target's LM
        head. ``max_lengths`` caps each request's draft.

        A request stops drafting (its ``length``) at the first token whose
        draft probability is below ``stop_below``; the batch runs on while any
        request is still drafting.
        """
        num = len(req.rows)
        rows = torch.as_tensor(req.rows, dtype=torch.int64)
        tokens = torch.as_tensor(req.last_tokens, dtype=torch.int64)
        positions = torch.as_tensor(req.positions, dtype=torch.int64)
        out_tok = np.zeros((num, steps), dtype=np.int64)
        out_p = np.zeros((num, steps), dtype=np.float32)
        lengths = (np.full(num, steps, dtype=np.int64) if max_lengths is None
                   else np.minimum(np.asarray(max_lengths, dtype=np.int64), steps))
        active = lengths > 0
        head = head or (lambda h: (self.logits(h), None))
        for j in range(steps):
            idx = np.flatnonzero(active)
            if idx.size == 0:
                break
            sel = torch.as_tensor(idx)
            pos = positions[sel] + j
            t0 = time.perf_counter()
            md, slots = self._metadata(rows[sel], torch.ones(idx.size, dtype=torch.int64),
                                       pos + 1, pos, write_kv=True)
            t1 = time.perf_counter()
            hidden, _ = self._forward(tokens[sel].to(self.device), pos.to(self.device),
                                      plan, md, slots)
            t2 = time.perf_counter()
            logits, ids = head(hidden)
            probs = torch.softmax(logits.float(), dim=-1)
            p, t = probs.max(dim=-1)
            if ids is not None:
                t = ids[t]
            t_np = t.cpu().numpy()
            p_np = p.cpu().numpy()
            out_tok[idx, j] = t_np
            out_p[idx, j] = p_np
            low = p_np < stop_below
            lengths[idx[low]] = j  # keep the tokens before the unsure one
            active[idx[low]] = False
            active &= lengths > j + 1
            tokens[sel] = t.cpu()
            t3 = time.perf_counter()
            SECONDS["metadata"] += t1 - t0
            SECONDS["layers"] += t2 - t1
            SECONDS["head"] += t3 - t2
        return SelfDraftResult(out_tok, out_p, lengths)

    # ---------------------------------------------------------------- score
    def score(self, rows: np.ndarray, windows: np.ndarray, starts: np.ndarray,
              plan: LayerPlan, capture: tuple[int, ...] = ()):
        """Teacher-forced predictions over committed context, without KV writes.

        ``windows[r]`` are tokens at positions ``starts[r] ..`` whose K/V the
        target already committed; returns the plan's argmax after each of them
        ([R, W]) and the captured streams. Queries attend over the target's own
        cache, so a plan is scored on exactly the context it will draft from.
        """
        num, width = windows.shape
        rows_t = torch.as_tensor(rows, dtype=torch.int64)
        pos = (torch.as_tensor(starts, dtype=torch.int64)[:, None]
               + torch.arange(width)[None, :]).reshape(-1)
        seq_lens = torch.as_tensor(starts, dtype=torch.int64) + width
        md, _ = self._metadata(rows_t, torch.full((num,), width, dtype=torch.int64),
                               seq_lens, pos, write_kv=False)
        ids = torch.as_tensor(windows, dtype=torch.int64).reshape(-1)
        hidden, captured = self._forward(ids.to(self.device), pos.to(self.device),
                                         plan, md, {}, capture)
        pred = self.logits(hidden).argmax(dim=-1).view(num, width).cpu().numpy()
        return pred, captured
