"""The front ends: how calls reach the application (``hicached.service``).

- ``envelope``: what every call goes through, whichever front end received it (metrics, error
  mapping, authentication, admission, the drain gate, access rules).
- ``grpc_service`` / ``interceptors``: ``hicache.v1.HostCache`` over gRPC.
- ``grpc_codec`` / ``fast_codec``: protobuf / ``fast_wire`` bodies <-> the method table's
  typed requests and results.
- ``fast_path``: the data calls over ``<socket>.fast`` (``hicache.fast_wire``).
- ``identity_channel``: ``<socket>.id``, where workers identify and hand over memfds.
- ``sockets``: the Unix sockets beside an API socket.
"""
