"""The front end's end of our counters: Prometheus counters beside vLLM's.

vLLM's ``StatLoggerManager`` (one per front end) hands every step's
``SchedulerStats`` of every engine to its loggers, ``PrometheusStatLogger``
among them, which serves ``/metrics``. Patch ``metrics.stat_logger`` adds
``PluginStatLogger`` to those loggers (``counters.wrap_stat_logger_manager``,
which imports this module only then); it adds the counters' growth each
report carries (``bridge/counters.py``) to ``vllm_plugins:<name>``
counters labelled as vLLM labels its own: ``model_name`` (the served model
name) and ``engine`` (the data-parallel rank's engine index), plus
``source`` for the hybrid's per-source counters. Prometheus sums engines.

On a front end whose engine drafts with one of our methods every unlabelled
counter is registered at start, at 0; elsewhere (an engine that only runs
our grammar processor, or none of ours) a counter appears when it first
grows, so an engine that uses nothing of ours shows nothing of ours.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, Counter
from vllm.v1.metrics.loggers import AggregateStatLoggerBase

from vllm_plugins.bridge.counters import BY_NAME, METRICS, PREFIX, STATS_FIELD, Metric

_LABELS = ["model_name", "engine"]


def unregister_ours() -> None:
    """Drops our counters from the default registry, so that a second front
    end in one process (tests, a restarted engine) registers them anew, as
    vLLM's ``unregister_vllm_metrics`` does for its own."""
    for collector in list(REGISTRY._collector_to_names):
        if getattr(collector, "_name", "").startswith(PREFIX):
            REGISTRY.unregister(collector)


class PluginStatLogger(AggregateStatLoggerBase):
    """``vllm_plugins:`` counters, one series per engine (and label)."""

    def __init__(self, vllm_config, engine_indexes: list[int]):
        from vllm_plugins.registry import PLUGIN_OPTIONS_ATTR

        unregister_ours()
        self.model_name = vllm_config.model_config.served_model_name
        self.engine_indexes = list(engine_indexes)
        self.counters: dict[str, Counter] = {}
        # (metric, engine index, label value) -> its labelled series:
        # Prometheus's own lookup builds and checks the label tuple each
        # time, and every step reports a dozen series.
        self.series: dict[tuple[str, int, str], object] = {}
        ours = getattr(vllm_config.speculative_config, PLUGIN_OPTIONS_ATTR, None)
        if ours is not None:
            for metric in METRICS:
                counter = self._counter(metric)
                if metric.label is None:
                    for engine in self.engine_indexes:
                        counter.labels(self.model_name, str(engine))

    def _counter(self, metric: Metric) -> Counter:
        counter = self.counters.get(metric.name)
        if counter is None:
            labels = _LABELS + ([metric.label] if metric.label else [])
            counter = Counter(name=PREFIX + metric.name, documentation=metric.documentation,
                              labelnames=labels)
            self.counters[metric.name] = counter
        return counter

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
               engine_idx: int = 0):
        grown = getattr(scheduler_stats, STATS_FIELD, None) if scheduler_stats else None
        if not grown:
            return
        known = self.series
        for name, values in grown.items():
            for label, value in values.items():
                series = known.get((name, engine_idx, label))
                if series is None:
                    series = self._series(name, engine_idx, label)
                    if series is None:
                        break
                series.inc(value)

    def _series(self, name: str, engine_idx: int, label: str):
        """The labelled series a report's value adds to, kept (None: not a
        metric of ours)."""
        metric = BY_NAME.get(name)
        if metric is None:
            return None
        counter = self._counter(metric)
        series = (counter.labels(self.model_name, str(engine_idx), label) if metric.label
                  else counter.labels(self.model_name, str(engine_idx)))
        self.series[(name, engine_idx, label)] = series
        return series

    def log_engine_initialized(self):
        pass

