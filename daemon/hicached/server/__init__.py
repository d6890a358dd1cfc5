"""The daemon process: its wiring, configuration, locks and metrics.

- ``config``: ``ServerConfig`` (typed, validated) and TOML-shaped loading.
- ``locks``: the flock'ed socket and state-directory locks.
- ``tallies``: per-call counts each thread adds to its own rows of, summed at scrape time.
- ``metrics`` / ``metrics_tiers``: Prometheus metrics on an injected registry, occupancy and
  the tiers at scrape time.
- ``app``: ``HiCacheServer``: the application (``hicached.service``) and its front ends
  (``hicached.frontends``) put together: listeners, health, reflection, the metrics
  endpoint, graceful drain.
"""
