"""Attaching the buffers a worker hands over, for the life of its session.

- ``base``: ``Attachment`` and the checks and assembly every transport shares.
- ``shm``: shared-memory files under the daemon's shm directory (CPU hosts).
- ``cuda_ipc``: the CUDA transport (GPU hosts): CUDA IPC memory and event handles, each
  allocation opened once per process and closed when its last session lets go.
- ``cuda_vmm``: VMM memory's chunks passed as fds, imported and mapped back to back per region
  for a session, released with it (used by ``cuda_ipc``).
"""
