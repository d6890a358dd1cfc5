"""What one daemon process serves, and the flows its RPCs run: no gRPC in here.

Primitives:

- ``Daemon``: the pool table, sessions, transports, copy engine and metrics of one process,
  with its drain state.
- ``enter(creates_work)`` / ``leave()`` / ``wait_idle(timeout)``: the drain gate. While
  draining, work-creating calls are refused with ``DRAINING``; the rest still answer.
- ``attach(buffers, layer_events, ready_event)``: the transport a session's buffers need (all
  ``shm`` or all ``cuda_ipc``), refusing mixtures, CUDA events on shm sessions, and
  ``cuda_ipc`` where the CUDA driver has no device (``TRANSPORT_UNAVAILABLE``).
- ``transfer(op, session_id, host, device, layers, layer_events)``: one backup or load on a
  session's buffers; a load with layer events keeps the session's mappings until its GPU
  copies land.
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass, field

from hicache.buffers import DeviceBufferSpec
from hicache.cuda_driver import driver_problem
from hicache.errors import Draining, SpecInvalid, TransportUnavailable
from hicache.indices import IndexArray
from hicached.copy.engine import Op, TransferEngine, TransferResult
from hicached.cuda.runner import CudaRunner
from hicached.server.metrics import Metrics
from hicached.server.pool_table import PoolTable
from hicached.server.sessions import SessionManager
from hicached.transport.base import Attachment
from hicached.transport.cuda_ipc import CudaIpcTransport
from hicached.transport.shm import ShmTransport


@dataclass
class Daemon:
    pools: PoolTable
    """Named pools under the memory budget."""
    sessions: SessionManager
    """Open worker sessions and their leases."""
    shm: ShmTransport
    """Attaches shared-memory buffers."""
    engine: TransferEngine
    """Runs backups and loads."""
    metrics: Metrics
    """Counters and the scrape-time collector."""
    cuda: CudaIpcTransport | None = None
    """The CUDA IPC transport; None on hosts without a usable CUDA driver."""
    cuda_driver: str = ""
    """The driver library the daemon was configured with ('' = the default)."""
    metrics_port: int = 0
    """The bound Prometheus port (0 = off)."""
    draining: threading.Event = field(default_factory=threading.Event)
    """Set once shutdown began: new work is refused."""
    in_flight: int = 0
    """RPCs being handled now."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- drain gate ------------------------------------------------------------------------

    def enter(self, creates_work: bool) -> None:
        with self._lock:
            if creates_work and self.draining.is_set():
                raise Draining("the daemon is shutting down; retry on its successor")
            self.in_flight += 1

    def leave(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self.in_flight == 0:
                    return True
            time.sleep(0.01)
        return False

    # -- flows -----------------------------------------------------------------------------

    def attach(self, buffers: list[DeviceBufferSpec], layer_events: list[bytes],
               ready_event: bytes) -> Attachment:
        kinds = {b.transport for b in buffers}
        if kinds == {"cuda_ipc"}:
            if self.cuda is None:
                raise TransportUnavailable(
                    f"cuda_ipc buffers cannot be attached: {driver_problem(self.cuda_driver)}",
                    metadata={"transport": "cuda_ipc", "buffers": len(buffers)})
            return self.cuda.attach(buffers, layer_events, ready_event)
        if len(kinds) > 1:
            raise SpecInvalid("a session's buffers use one transport, shm or cuda_ipc",
                              metadata={"transports": ",".join(sorted(kinds))})
        if layer_events or ready_event:
            raise SpecInvalid("layer_events and ready_event are CUDA events; shm sessions "
                              "complete every transfer before replying",
                              metadata={"layer_events": len(layer_events)})
        return self.shm.attach(buffers)

    def transfer(self, op: Op, session_id: str, host: IndexArray, device: IndexArray,
                 layers: tuple[int, int], layer_events: bool) -> TransferResult:
        """One backup or load; with ``layer_events`` a load returns once enqueued."""
        if op is Op.BACKUP and layer_events:
            raise SpecInvalid("backups always complete before the reply; "
                              "COMPLETION_LAYER_EVENTS is for loads",
                              metadata={"completion": "COMPLETION_LAYER_EVENTS"})
        sessions = self.sessions
        with sessions.transfer(session_id) as s:
            buffers = s.attachment.buffers
            runner = s.attachment.runner
            assert buffers is not None, "a session in use keeps its mappings"
            if op is Op.BACKUP:
                r = self.engine.backup(s.pool, buffers, host, device, *layers, runner=runner)
            else:
                if layer_events and not (isinstance(runner, CudaRunner)
                                         and runner.layer_events):
                    raise SpecInvalid("COMPLETION_LAYER_EVENTS needs a CUDA session opened "
                                      "with layer_events",
                                      metadata={"completion": "COMPLETION_LAYER_EVENTS"})
                sessions.hold(s)  # released when the GPU copies land
                try:
                    r = self.engine.load(s.pool, buffers, host, device, *layers, runner=runner,
                                         wait=not layer_events,
                                         on_complete=functools.partial(sessions.unhold, s))
                except BaseException:
                    sessions.unhold(s)
                    raise
                if not r.pending:
                    sessions.unhold(s)
        self.metrics.transfer(s.pool_name, op.value, r.bytes, r.pages, r.seconds)
        return r
