"""What the daemon tells others unasked: the KV event stream routers follow.

Beside the front ends (which answer calls), under the wiring: it follows the pools' event
logs and publishes them over ZeroMQ in the engines' own formats.

- ``kv_event_config``: ``KvEventsConfig`` (``[kv_events]``) and ``KvEventStats``.
- ``kv_event_format``: the cache's events as SGLang's / vLLM's ``KVEventBatch``.
- ``kv_events``: ``KvEventPublisher``, the PUB and replay sockets.
- ``kv_channel``: ``Channel``: one stream's PUB (or XPUB) and replay sockets, its sequence, the
  batches kept for replay.
"""
