"""Tiers below host memory: where a pool's keyed pages go when host memory is full.

- ``disk_format``: the page and index files of the disk tier, checksums.
- ``disk``: ``DiskTier``: one pool's pages on local disk, LRU within a capacity, restartable.
- ``spill``: ``Spiller``: writes the least recently used ready keys of a pool to its tier ahead
  of eviction, through a bounded window, so eviction itself never waits on I/O.
- ``config``: ``DiskTierConfig`` (``[tier.disk]``).
- ``disk_io``: ``PageFile``: one page to or from a slot (O_DIRECT, bounce buffers).
- ``writer``: ``TierWriter``: the one background writer (spill, write-through), backed off
  while its tier fails.
- ``prefetch``: ``Prefetcher``: a held Lookup's keys below host memory read up.
- ``mooncake_config``: ``MooncakeTierConfig`` (``[tier.mooncake]``), the cluster tier's settings.
- ``mooncake``: ``MooncakeStore``: the daemon's one Mooncake client, every call bounded in time.
- ``mooncake_replicas``: gets that fall back across replicas (a dead node's copy).
- ``cluster``: ``ClusterTier``: one pool's part of the cluster tier, pages moved with no copy.
- ``cluster_writer``: ``ClusterWriter``: write-through to the cluster tier.
- ``stack``: ``TierStack``: a pool's tiers as Lookup / LoadKeys / RemoveKeys see them.

Above ``cache`` (the spiller reads a pool's LRU), beside ``copy``; the cache knows a lower tier
only through its ``LowerTier`` protocol.
"""
