"""The GPU side of the daemon, on the CUDA driver API (``hicache.cuda_driver``, loaded on first
use; nothing here runs on hosts without a GPU).

- ``pinner``: page-locking pool memory (``cuMemHostRegister``), injected into the core.
- ``segments``: a copy plan as the fewest 1-D / 2-D async copies, submitted in one call.
- ``runner``: the per-session ``CudaRunner`` (streams, ready and layer events) and the
  ``Completer`` thread.
"""
