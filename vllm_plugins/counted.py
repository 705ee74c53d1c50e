"""What reports counters to the server's ``/metrics``.

A drafter (``vllm_plugins.drafter.Drafter``) and a logits processor of ours
(the grammar processor) each keep totals that only grow; the bridge reads
them after every step and sends what grew through vLLM's own stat path
(``vllm_plugins/bridge/counters.py``, which declares every metric name). A
logits processor subclasses this interface to be read: the bridge finds it
among the runner's processors by it, on either model runner, every step (an
ABC: its ``isinstance`` is cached, a runtime-checked Protocol's is not).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

#: {metric: {label value: total}}, "" where the metric has no label of its own.
Totals = dict[str, dict[str, int]]


class Counted(ABC):
    @abstractmethod
    def counters(self) -> Totals:
        """Totals that only grow. Read after every step: plain reads."""
