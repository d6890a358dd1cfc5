"""SGLang integration: ``hicache_sglang.linker.HicachedLinker``, the unified-cache external
linker SGLang loads by dotted path, so an SGLang worker's KV pages live in the hicached sidecar.

Modules: ``config`` (the linker's extra config), ``namespace`` (which pool a worker's pages go
to), ``device_pool`` (SGLang's device pool as a hicached pool spec and handover), ``link`` (the
session, re-established in the background), ``linker`` (the linker; imports SGLang),
``answers`` (each request's lookup answer and what SGLang's next match is told), ``offloads``
(write-through Stores that never wait for the GPU), ``origins`` (an offloaded node's tokens,
parent key, cache salt and LoRA name, for routers), ``quarantine`` (device slots of a load that
timed out, kept from SGLang's allocator until no copy into them can run), ``served`` (imported
first: an SGLang release hicached does not serve stops at start-up).

Importing this package does not import SGLang, torch or gRPC; ``hicache_sglang.linker`` does.
"""
