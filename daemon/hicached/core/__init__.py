"""The core of the daemon: host pools and the rules every transfer obeys. No RPC, no driver.

- ``system``: usable CPUs, available memory, the memory check.
- ``validation``: vectorized checks of index batches, every violation collected.
- ``allocator``: whole pages out and back, busy marks, generations.
- ``canary``: kv-canary fingerprints per (page, layer).
- ``memory``: mapped, prefaulted host memory; pinning through an injected ``Pinner``.
- ``pin_units``: a pool pinned by units that follow its share of an elastic budget.
- ``registrations``: where a pool's page-locked registrations meet (no GPU copy spans two).
- ``host_layout``: where each row of a component lives for each host layout.
- ``pool``: a host pool (members, components, allocator, canary).
- ``worker_buffers``: a worker's KV buffers (CPU or GPU) checked against a pool's geometry.
- ``state_file``: a pool's files under the state directory: header, tables, outcomes.
- ``trusted_paths``: own directories made 0700 and verified, files opened without following
  links.
"""
