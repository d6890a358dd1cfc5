"""Tiers below host memory: where a pool's keyed pages go when host memory is full.

- ``disk_format``: the page and index files of the disk tier, checksums.
- ``disk``: ``DiskTier``: one pool's pages on local disk, LRU within a capacity, restartable.
- ``spill``: ``Spiller``: writes the least recently used ready keys of a pool to its tier ahead
  of eviction, through a bounded window, so eviction itself never waits on I/O.

Above ``cache`` (the spiller reads a pool's LRU), beside ``copy``; the cache knows a lower tier
only through its ``LowerTier`` protocol.
"""
