"""Attaching the buffers a worker hands over, for the life of its session.

- ``base``: ``Attachment`` and the checks and assembly every transport shares.
- ``shm``: shared-memory files under the daemon's shm directory (CPU hosts).
- ``cuda_ipc``: CUDA IPC memory and event handles (GPU hosts), each allocation opened once per
  process and closed when its last session lets go.
"""
