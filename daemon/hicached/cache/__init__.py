"""The cache: pages named by content keys, found again by every worker and instance.

- ``lru``: the eviction policy (least recently used ready keys no copy is using).
- ``events``: the STORED / REMOVED / EVICTED log routers follow.
- ``pool_cache``: ``PoolCache``: keys -> pages, writing / ready states, store / load / remove /
  clear, eviction, statistics.

It sits beside ``copy`` above ``core``: the daemon resolves keys here, moves bytes with the copy
engine, then finishes here.
"""
