"""Worker RPC targets: what a caller reads of our state on a worker's
runner, whichever runner it is (V1's ``runner.wrap_after_load`` and V2's
``V2Drafter.attach`` put the same ``RunnerState`` there).

``vllm.v1.worker.worker_base.WorkerBase``: ``collective_rpc("name")`` calls
``getattr(worker, name)()``; string methods need no insecure pickling. Each
is an added attribute (``Patch(..., adds=True)`` in ``patches``).
"""

from __future__ import annotations

from vllm_plugins.bridge import ranks
from vllm_plugins.bridge.state import attach, state_of


def add_read_stats(_missing):
    def vllm_plugins_stats(worker) -> dict:
        """The runner's step counters and our proposer's metrics ({} when the
        runner carries nothing of ours)."""
        state = state_of(worker.model_runner)
        if state is None:
            return {}
        out = state.counters.as_dict()
        if state.proposer is not None:
            out["proposer"] = state.proposer.metrics()
        return out

    return vllm_plugins_stats


def add_count_steps(_missing):
    def vllm_plugins_count_steps(worker) -> None:
        """Opt-in step counting for a runner whose drafter is vLLM's own (a
        benchmark's baseline); runners of our proposers always count."""
        attach(worker.model_runner)

    return vllm_plugins_count_steps


def add_live_state(_missing):
    def vllm_plugins_live_state(worker) -> dict:
        """Counts of what our state holds now (``bridge.live_state``), for a
        leak check on an idle engine; {} when the runner carries nothing of
        ours."""
        from vllm_plugins.bridge.live_state import live_counts

        state = state_of(worker.model_runner)
        if state is None:
            return {}
        return live_counts(state, getattr(worker.model_runner, "requests", {}) or {})

    return vllm_plugins_live_state


def add_rank_digest(_missing):
    def vllm_plugins_rank_digest(worker) -> list[str]:
        """Per-step digests of this rank's drafts, draft probabilities and
        token history (ranks.RankDigest). The first call turns digests on
        and returns []; later calls return every step's since then."""
        state = state_of(worker.model_runner)
        if state is None or state.proposer is None:
            return []
        if state.digest is None:
            state.digest = ranks.RankDigest()
        return list(state.digest.steps)

    return vllm_plugins_rank_digest
