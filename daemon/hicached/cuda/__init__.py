"""The GPU side of the daemon, on the CUDA driver API (``hicache.cuda_driver``, loaded on first
use; nothing here runs on hosts without a GPU).

- ``pinner``: page-locking pool memory (``cuMemHostRegister``, mapped into the devices),
  injected into the core.
- ``segments``: a copy plan as the fewest 1-D / 2-D async copies, submitted in one call.
- ``paths``: the ways a batch may go (``dma``, ``batch``, ``kernel``) and the choice among
  them by measured rate.
- ``nvrtc``: NVRTC through ctypes, to compile the kernels at run time.
- ``kernels``: the kernels' binaries (``pages.cu``) per architecture, cached under the state
  directory, and loading the page kernel on a device.
- ``launch``: a batch's plans as one launch table, the page-locked slots tables go in, the
  page kernel's launch.
- ``runner``: the per-session ``CudaRunner`` (streams, ready and layer events, the way each
  batch takes), the per-device ``DeviceCopies`` and the ``Completer`` thread.
"""
