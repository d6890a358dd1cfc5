"""What the scheduler-side manager tells vLLM's metrics: its link to hicached, as vLLM's own
offloading metrics.

vLLM collects ``OffloadingManager.get_stats()`` once per scheduler step and exposes each name
the spec declared (``OffloadingSpec.build_metric_definitions``) on the server's Prometheus
endpoint, beside its own offloading metrics (load and store bytes and times, lookup delays).
The manager counts as it goes (``HicachedOffloadingManager.stats`` and its promises' stats);
``Reporter.collect`` turns what changed since the last step into counter increases and reads
the links' state as gauges, so an operator sees from vLLM's side what the daemon gave this
engine: blocks held for its lookups, misses, stores dropped while the daemon was away.

Primitives:

- ``COUNTERS``: metric name -> (the stats key it counts, its help text); ``LINKS_UP``: the
  gauge of the engine's pools the daemon serves now (one link per rank's pool).
- ``definitions()``: the names as vLLM's metric metadata (what the spec declares).
- ``Reporter()``: ``collect(stats, links_up, links)`` -> ``OffloadingConnectorStats``.
"""

from __future__ import annotations

from collections.abc import Mapping

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
)

_P = "vllm:kv_offload_hicached_"

COUNTERS: dict[str, tuple[str, str]] = {
    _P + "lookups": ("lookups", "Lookups this engine sent to hicached (each holds the hit)."),
    _P + "lookup_failures": ("lookup_failures",
                             "Lookups that failed or missed their deadline (all misses)."),
    _P + "lookups_down": ("lookups_down",
                          "Blocks looked up while hicached was down (misses at once)."),
    _P + "held_blocks": ("held_blocks",
                         "Blocks hicached held for this engine's lookups: its hits."),
    _P + "miss_blocks": ("miss_blocks", "Blocks looked up that hicached did not have."),
    _P + "deferred": ("deferred",
                      "Blocks answered RETRY: asked at the step's end, the request a step "
                      "later."),
    _P + "load_blocks": ("load_blocks", "Blocks this engine loaded from hicached."),
    _P + "store_blocks": ("store_blocks", "Blocks this engine stored into hicached."),
    _P + "stores_dropped": ("stores_dropped",
                            "Stores dropped because hicached was not connected."),
    _P + "touched_blocks": ("touched_blocks",
                            "Blocks vLLM said are in use (touch), sent to hicached as used."),
    _P + "touches_dropped": ("touches_dropped",
                             "Touched blocks not sent (hicached away, or too many waiting)."),
}
"""Counters by metric name: the stats key each counts and its help text."""

LINKS_UP = _P + "links_up"
"""Gauge: how many of the engine's pools (one per rank's) the daemon serves now."""


def definitions() -> dict[str, OffloadingMetricMetadata]:
    out: dict[str, OffloadingMetricMetadata] = {
        name: OffloadingCounterMetadata(documentation=doc)
        for name, (_, doc) in COUNTERS.items()}
    out[LINKS_UP] = OffloadingGaugeMetadata(
        documentation="The engine's hicached pools (one per rank's) whose link is up.")
    return out


class Reporter:
    """Counter increases since the last ``collect`` (vLLM sums them across steps)."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def collect(self, stats: Mapping[str, int], links_up: int) -> OffloadingConnectorStats:
        """``stats``: the manager's running totals (every key ``COUNTERS`` names, missing
        ones 0); ``links_up``: the gauge's value now."""
        out = OffloadingConnectorStats()
        for name, (key, _) in COUNTERS.items():
            now = int(stats.get(key, 0))
            delta = now - self._last.get(key, 0)
            self._last[key] = now
            if delta:
                out.increase_counter(name, delta)
        out.set_gauge(LINKS_UP, links_up)
        return out
