"""The daemon process: gRPC service, its interceptors, sessions, pools, metrics, lifecycle.

- ``config``: ``ServerConfig`` (typed, validated) and TOML-shaped loading.
- ``pool_table``: named pools under one memory budget.
- ``sessions``: worker sessions with leases, reaped when workers go quiet.
- ``metrics``: Prometheus metrics on an injected registry, occupancy at scrape time.
- ``daemon``: the state one process serves and the flows of its RPCs (no gRPC).
- ``interceptors``: error mapping, metrics and the drain gate as ``grpc.ServerInterceptor``s.
- ``service``: the ``hicache.v1.HostCache`` handlers: decode, call, encode.
- ``app``: listeners, health, reflection, metrics endpoint, graceful drain.
"""
