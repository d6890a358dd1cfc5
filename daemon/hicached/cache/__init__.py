"""The cache: pages named by content keys, found again by every worker and instance.

- ``lru``: ``LRU``, an eviction policy: least recently used ready keys no copy is using first.
- ``reuse_lru``: ``ReuseLRU``, the default eviction policy: reused pages outlive pages used
  once by a margin each pool learns, a batch's deepest first.
- ``events``: the STORED / REMOVED / EVICTED log routers follow.
- ``key_index``: ``KeyIndex``: keys -> pages, writing / ready states, readers, spills and the
  eviction order of one pool (no lock: its pool cache's).
- ``pool_cache``: ``PoolCache``: over a ``KeyIndex``: lookup / store / load / remove / clear,
  eviction, statistics; its roles, each a class over its lock and books:
- ``held_pages``: ``HeldPages``: the holds Lookups take, as read-held pages;
- ``lending``: ``Lending``: pages lent to the tiers below, with the epochs removals check;
- ``sizing``: ``Sizing``: the pool's share of a memory budget (grow, resize).
- ``holds``: ``Holder``, ``HoldPolicy``, ``HoldTable``: the books of the holds Lookups take.
- ``removals``: ``RemovalLog``: removals numbered, and the epochs of the writers lent pages,
  so a key removed never comes back through a tier below.
- ``chains``: ``ChainTable``: each recent key's parent and tokens (a Store's chain).
- ``index_types``: store tickets and status bytes, the ``LowerTier`` protocol, counters.
- ``key_slots``: which key each page holds, in the state file (crash-ordered).

It sits beside ``copy`` above ``core``: the daemon resolves keys here, moves bytes with the copy
engine, then finishes here.
"""
