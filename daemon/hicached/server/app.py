"""Process lifecycle: listeners, health, reflection, metrics endpoint, graceful drain.

Primitives:

- ``create_server(config) -> (server, bound_addresses)``: everything wired and started;
  ``unix:`` listeners get a 0600 socket guarded by an flock'ed lock file, so a second instance
  refuses to start (``AlreadyServing``) while a socket left by a killed daemon is replaced.
- ``HiCacheServer``: ``daemon``, ``metrics_port``, ``drain_and_stop(grace)`` (health
  NOT_SERVING, refuse new work with UNAVAILABLE, let in-flight transfers finish, stop with a
  grace period, close sessions and free pool memory), ``begin_drain(grace)`` (the same in the
  background, for the Drain RPC) and ``wait()``.

The daemon's state and flows are in ``daemon``, its handlers in ``service``, what every call
needs in ``interceptors``; this module only wires them to listeners and a process.
"""

from __future__ import annotations

import grp
import logging
import os
import platform
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector

import hicache
from hicache.cuda_driver import CudaDriver, driver_problem, load_driver
from hicache.errors import PinFailed, SpecInvalid
from hicache.locks import lock
from hicache.paths import FAST_PATH_SUFFIX, IDENTITY_SUFFIX, beside, default_socket_path, unix_path
from hicache.polling import sum_counts
from hicache.v1 import hicache_pb2 as pb
from hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicached.copy.engine import TransferEngine
from hicached.core.pool import HostPool, MemoryOptions
from hicached.core.system import lock_refusal
from hicached.core.trusted_paths import own_dir, socket_dir
from hicached.cuda.kernels import KernelBinaries
from hicached.cuda.nvrtc import load_nvrtc, nvrtc_problem
from hicached.cuda.paths import Path as CopyPath
from hicached.cuda.pinner import DriverPinner
from hicached.frontends.envelope import Envelope
from hicached.frontends.fast_path import FastPathServer
from hicached.frontends.grpc_service import HostCacheServicer
from hicached.frontends.identity_channel import IdentityChannel
from hicached.frontends.interceptors import server_interceptors
from hicached.publish.kv_event_config import seq_file
from hicached.server.config import ServerConfig
from hicached.server.locks import PidLock, SocketLock, state_lock
from hicached.server.metrics import Metrics, MetricsEndpoint, ScrapeState, serve
from hicached.service.admission import ByteBudget, DataGate
from hicached.service.daemon import Daemon
from hicached.service.memory_budget import MemoryBudget
from hicached.service.pool_build import PoolBuild
from hicached.service.pool_table import PoolTable
from hicached.service.request_bounds import RequestBounds
from hicached.service.sessions import SessionManager
from hicached.tiers.mooncake import MooncakeStore
from hicached.transport.cuda_ipc import CudaIpcTransport
from hicached.transport.shm import ShmTransport

if TYPE_CHECKING:
    from hicached.publish.kv_events import KvEventPublisher

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["HostCache"].full_name


DATA_SPARE_THREADS = 2
"""Data threads beyond ``max_data_rpcs``: the call past the bound is refused at once."""


class HiCacheServer:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        sessions = SessionManager(config.lease_seconds,
                                  max_lease_seconds=config.max_lease_seconds,
                                  on_end=lambda s: self.daemon.session_ended(s),
                                  on_tick=lambda: self.daemon.expire_holds())
        options = MemoryOptions(hugepages=config.hugepages, reserve_bytes=config.reserve_bytes,
                                state_dir=config.state_dir,
                                pin_unit_bytes=config.budget.pin_unit_bytes)
        driver = load_driver(config.cuda_driver or None)
        if driver is None:
            log.info("CUDA IPC off: %s", driver_problem(config.cuda_driver or None))
        else:
            log.info("CUDA IPC on: %s", ", ".join(f"{d.ordinal}={d.uuid} ({d.name})"
                                                   for d in driver.devices))
        if driver is not None and config.state_dir:
            refusal = lock_refusal(config.state_dir)
            if refusal is not None:  # every pool would fail to pin: say so before any starts
                raise PinFailed(f"state_dir {refusal}; this host has a GPU, so pools are "
                                f"pinned: point state_dir at a tmpfs or hugetlbfs mount (the "
                                f"default is /dev/shm/hicached-<uid>), or set it to \"\" "
                                f"(pools in anonymous memory, lost when the daemon exits)",
                                metadata={"state_dir": config.state_dir})
        cuda = cuda_transport(driver, config) if driver is not None else None
        cluster_store = (MooncakeStore(config.mooncake, observe=lambda op, s: self.metrics
                                       .observe_cluster(op, s))
                         if config.mooncake is not None else None)
        self.kv_events: KvEventPublisher | None = None
        """The KV event stream (``[kv_events]``), if one is configured (ZeroMQ is loaded
        only then)."""
        if config.kv_events.enabled:
            from hicached.publish.kv_events import KvEventPublisher

            self.kv_events = KvEventPublisher(config.kv_events, seq_file(config.state_dir),
                                              config.socket_mode)
        budget = config.effective_budget()  # read once: without a set size it follows MemAvailable
        self.budget = MemoryBudget(budget, config.budget)
        """The memory budget; pools share it by demand where ``[budget] elastic`` is set."""
        # pools are page-locked for DMA exactly where the CUDA driver has a device
        pools = PoolTable(budget, options, sessions.count,
                          pinner=DriverPinner(driver) if driver is not None else None,
                          on_attach=lambda pool, rec: self.metrics.pool_attached(
                              pool, rec),
                          on_drop=lambda name, outcome: self.metrics.pool_dropped(
                              name, outcome),
                          on_delete=lambda name: self.metrics.pool_deleted(name),
                          disk=config.disk,
                          observe_disk=lambda op, s: self.metrics.disk_seconds.labels(
                              op).observe(s),
                          cluster_store=cluster_store, hold_policy=config.hold_policy(),
                          eviction=config.eviction,
                          chain_bytes=config.kv_events.chain_bytes, listener=self.kv_events,
                          budget=self.budget)
        self.metrics = metrics = Metrics(self.registry, ScrapeState(
            pools=pools.entries, sessions_open=sessions.count,
            sessions_reaped=lambda: sessions.reaped_total,
            attached_bytes=lambda: sessions.attached_bytes,
            ipc_handles=cuda.cache.stats if cuda is not None else lambda: (0, 0),
            vmm_chunks=cuda.vmm if cuda is not None else lambda: (0, 0),
            watchers=lambda: self.daemon.watchers,
            builds=lambda: [(b.spec.name, b.state, b.progress) for b in pools.builds()],
            tiers=pools.stacks, cluster_store=cluster_store,
            fast_connections=lambda: sum(f.connections for f in self.fast_paths),
            fast_polls=lambda: sum_counts(*(f.poll_stats() for f in self.fast_paths)),
            kv_events=self.kv_events.stats if self.kv_events is not None else None,
            budget=pools.budget,
            cuda_copies=cuda.copy_stats if cuda is not None else None,
            tables=lambda: self.tables(),
        ), build={"version": hicache.__version__, "numpy": np.__version__,
                  "cuda_available": str(driver is not None).lower(),
                  "python": platform.python_version()})
        self.daemon = Daemon(pools, sessions, ShmTransport(config.shm_dir, config.accept_shm_paths),
                             TransferEngine(config.copy_threads, config.copy_spin_us),
                             metrics, cuda=cuda, cuda_driver=config.cuda_driver,
                             max_watchers=config.max_watchers, access=config.access,
                             max_keys_per_call=config.max_keys_per_call,
                             begin_drain=self.begin_drain)
        self.health = health.HealthServicer()
        self._locks: list[PidLock] = []
        self._stopped = threading.Event()
        self._drain_lock = lock("server.drain")
        self.metrics_port = 0
        self._declared: list[HostPool | PoolBuild] = []
        self._ready = threading.Event()
        self.health_bound: list[str] = []
        """Where the health-only server listens (``health_listen``)."""
        self._metrics_server: MetricsEndpoint | None = None
        opts = [("grpc.max_receive_message_length", config.max_message_bytes),
                ("grpc.max_send_message_length", config.max_message_bytes),
                ("grpc.so_reuseport", 0)]
        # data calls on their own threads (a few beyond the admission bound, so a refusal
        # never waits for one); control calls and health keep the server's
        self.data_pool = ThreadPoolExecutor(config.max_data_rpcs + DATA_SPARE_THREADS,
                                            thread_name_prefix="data")
        self.admission = DataGate(config.max_data_rpcs)
        self.frame_budget = ByteBudget(config.fast_path_inflight_bytes)
        """The data path's gate (its ``in_flight`` and ``limit``), over gRPC and the fast
        path together."""
        self.identity_channels: list[IdentityChannel] = []
        """The identity socket beside each Unix API socket."""
        self.fast_paths: list[FastPathServer] = []
        """The fast path beside each Unix API socket (``fast_path``)."""
        self.envelope = Envelope(self.daemon, self.admission, metrics, _read_token(config))
        """What every call goes through, on gRPC and on the fast path."""
        interceptors = server_interceptors(
            self.envelope, self.data_pool,
            RequestBounds(config.max_keys_per_call, self.daemon.pools.max_page_tokens))
        self.grpc = grpc.server(
            ThreadPoolExecutor(config.grpc_threads, thread_name_prefix="rpc"), options=opts,
            interceptors=interceptors,
            maximum_concurrent_rpcs=config.grpc_threads + config.max_data_rpcs
            + DATA_SPARE_THREADS + config.max_pending_rpcs)
        # probes get their own server and threads: no API call can queue in front of them
        self.health_grpc = grpc.server(ThreadPoolExecutor(2, thread_name_prefix="health"),
                                       options=[("grpc.so_reuseport", 0)],
                                       maximum_concurrent_rpcs=64)
        pb_grpc.add_HostCacheServicer_to_server(  # type: ignore[no-untyped-call]
            HostCacheServicer(self.daemon), self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_grpc)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.grpc)

    def start(self) -> list[str]:
        bound: list[str] = []
        try:
            self._trust_dirs()  # before any lock, socket or pool file is opened there
            # probes answer from the start: alive at once, ready once the API serves
            self.health.set("", health_pb2.HealthCheckResponse.SERVING)
            self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
            self.health_bound = [self._listen(t, self.health_grpc)
                                 for t in self.config.health_listen]
            if self.health_bound:
                self.health_grpc.start()
            if self.config.state_dir:  # before any pool touches its files
                self._locks.append(state_lock(self.config.state_dir))
            if self.kv_events is not None:  # before any pool: its first event opens it
                self.kv_events.start()
                self.daemon.kv_events = (self.kv_events.endpoint,
                                         self.kv_events.replay_endpoint,
                                         self.config.kv_events.topic)
                self.daemon.pool_streams = self.kv_events.pool_endpoints
            if self.daemon.pools.cluster_store is not None:  # connects in the background
                self.daemon.pools.cluster_store.start()
            # declared pools build in the background (a budget error still stops the start);
            # pools saved by an earlier daemon are re-attached the same way
            self._declared = [self.daemon.pools.create_async(spec)[0]
                              for spec in self.config.pools]
            self._declared += self.daemon.pools.recover_saved(
                {spec.name for spec in self.config.pools})
            if self.daemon.pools.budget is not None:
                self.daemon.pools.budget.start()  # rebalances the pools' shares
            for target in self.config.listen:
                bound.append(self._listen(target))
            if self.config.metrics_listen:
                self._metrics_server, self.metrics_port = serve(self.metrics,
                                                                self.config.metrics_listen)
                self.daemon.metrics_port = self.metrics_port
            self.grpc.start()
            for target in bound:
                if target.startswith("unix:"):
                    self._secure_socket(unix_path(target))
                    channel = IdentityChannel(beside(unix_path(target), IDENTITY_SUFFIX),
                                              self.config.socket_mode, self._socket_gid())
                    channel.start()
                    self.identity_channels.append(channel)
                    self.daemon.identities.append(channel)
                    if self.config.fast_path:
                        fast = FastPathServer(self.envelope,
                                              beside(unix_path(target), FAST_PATH_SUFFIX),
                                              mode=self.config.socket_mode,
                                              gid=self._socket_gid(),
                                              max_frame_bytes=self.config.max_message_bytes,
                                              spin_us=self.config.fast_path_spin_us,
                                              body_timeout=self.config.fast_path_body_timeout_s,
                                              budget=self.frame_budget)
                        fast.start()
                        self.fast_paths.append(fast)
                        self.daemon.fast_paths.append(fast.path)
            for target in self.health_bound:  # health says nothing a local user may not see
                if target.startswith("unix:"):
                    os.chmod(unix_path(target), 0o666)
        except BaseException:
            self._release()
            raise
        self.daemon.sessions.start_reaper()
        threading.Thread(target=self._ready_when_built, name="declared-pools",
                         daemon=True).start()
        log.info("hicached %s serving on %s (metrics port %s, budget %d bytes, shm dir %s)",
                 hicache.__version__, ", ".join(bound), self.metrics_port or "off",
                 self.daemon.pools.budget_bytes, self.config.shm_dir)
        return bound

    def _ready_when_built(self) -> None:
        """Readiness turns SERVING once every declared pool is built (failed ones logged)."""
        for b in self._declared:
            if isinstance(b, PoolBuild):
                b.wait()
                if b.error is not None:
                    log.error("declared pool %s failed to build: %s", b.spec.name, b.error)
        self._ready.set()
        if not self.daemon.draining.is_set():
            self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once the declared pools are built and readiness is SERVING."""
        return self._ready.wait(timeout)

    def _trust_dirs(self) -> None:
        """The directories the daemon's files go in, created or verified (``UntrustedPath``:
        the daemon does not start): the state directory and the default socket directory are
        its own; a configured socket's directory must be one no one else can write in."""
        group, gid = self.config.socket_mode == 0o660, self._socket_gid()
        if self.config.state_dir:
            own_dir(self.config.state_dir)
        for target in (*self.config.listen, *self.config.health_listen):
            if target.startswith("unix:"):
                path = os.path.abspath(unix_path(target))
                if path == default_socket_path():
                    own_dir(os.path.dirname(path), group, gid)
                else:
                    socket_dir(os.path.dirname(path), group, gid)

    def _socket_gid(self) -> int:
        """The configured socket group's gid; -1 = leave the daemon's own."""
        group = self.config.socket_group
        return grp.getgrnam(group).gr_gid if group else -1

    def _secure_socket(self, path: str) -> None:
        """The socket's mode and group from the config (the unit's Group= by default)."""
        os.chown(path, -1, self._socket_gid())
        os.chmod(path, self.config.socket_mode)

    def _listen(self, target: str, server: grpc.Server | None = None) -> str:
        server = server or self.grpc
        if target.startswith("unix:"):
            path = os.path.abspath(unix_path(target))
            self._locks.append(SocketLock(path))
            server.add_insecure_port(f"unix:{path}")
            return f"unix:{path}"
        if server is not self.grpc:  # health only: nothing to protect, probes speak plain
            port = server.add_insecure_port(target)
        elif self.config.tls_cert:
            port = self.grpc.add_secure_port(target, _server_credentials(self.config))
        else:
            port = self.grpc.add_insecure_port(target)
        if port == 0:
            raise OSError(f"cannot listen on {target}")
        host = target.rpartition(":")[0]
        return f"{host}:{port}"

    def begin_drain(self, grace: float = 0.0) -> float:
        """Start ``drain_and_stop`` in the background (0 = the configured grace); returns the
        grace period that applies. New work is refused from the moment this returns."""
        grace = grace or self.config.grace_seconds
        self.daemon.draining.set()
        threading.Thread(target=self.drain_and_stop, args=(grace,), name="drain",
                         daemon=True).start()
        return grace

    def drain_and_stop(self, grace: float | None = None) -> None:
        """SIGTERM path: NOT_SERVING, refuse new work, finish in-flight transfers, stop. A
        second caller waits for the first drain to finish."""
        with self._drain_lock:
            if not self._stopped.is_set():
                self._drain_and_stop(self.config.grace_seconds if grace is None else grace)

    def _drain_and_stop(self, grace: float) -> None:
        log.info("draining: refusing new work, waiting up to %.1fs for in-flight requests",
                 grace)
        self.health.enter_graceful_shutdown()
        self.daemon.draining.set()
        if not self.daemon.wait_idle(grace):
            log.warning("in-flight requests still running after %.1fs; stopping anyway", grace)
        for fast in self.fast_paths:
            fast.close()
        self.grpc.stop(grace=min(grace, 1.0)).wait()
        self.data_pool.shutdown(wait=False, cancel_futures=True)
        self._release()
        log.info("hicached stopped")

    def _release(self) -> None:
        self.health_grpc.stop(grace=None)
        for fast in self.fast_paths:
            fast.close()
        for channel in self.identity_channels:
            channel.close()
        self.daemon.sessions.close_all()
        if self.daemon.cuda is not None:
            self.daemon.cuda.close()  # GPU copies still running finish, then sessions release
        self.budget.close()
        self.daemon.pools.close_all()
        if self.kv_events is not None:
            self.kv_events.close()
        if self.daemon.pools.cluster_store is not None:
            self.daemon.pools.cluster_store.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server = None
        for held in self._locks:
            held.release()
        self._locks = []
        self._stopped.set()

    def tables(self) -> dict[str, int]:
        """The sizes ``hicache_table_entries`` shows (see ``ScrapeState.tables``)."""
        d = self.daemon
        books: Counter[str] = Counter()
        for _, cache in d.pools.entries():
            books.update(cache.books())  # summed over the pools
        out = {**books, **self.metrics.tally_sizes()}
        out["sessions"] = d.sessions.count()
        out["sessions_ending"] = d.sessions.ending
        out["pools"] = len(d.pools.list())
        out["fast_path_connections"] = sum(f.connections for f in self.fast_paths)
        out["identity_grants"] = sum(c.grants for c in self.identity_channels)
        return out

    def wait(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)


def cuda_transport(driver: CudaDriver, config: ServerConfig) -> CudaIpcTransport:
    """CUDA IPC sessions, their copies by ``config.cuda_copy_paths``: the page kernel compiled
    with NVRTC where it is allowed, cached under the state directory."""
    paths = tuple(CopyPath(p) for p in config.cuda_copy_paths)
    binaries, off = None, ""
    if CopyPath.KERNEL in paths:
        nvrtc = load_nvrtc()
        if nvrtc is None:
            off = nvrtc_problem()
        else:
            cache = os.path.join(config.state_dir, "kernels") if config.state_dir else ""
            binaries = KernelBinaries(cache, nvrtc)
    return CudaIpcTransport(driver, paths, binaries, off)


def _read_token(config: ServerConfig) -> str:
    if not config.auth_token_file:
        return ""
    with open(config.auth_token_file) as f:
        token = f.read().strip()
    if len(token) < 16:
        raise SpecInvalid("auth_token_file must hold a token of at least 16 characters",
                          metadata={"auth_token_file": config.auth_token_file})
    return token


def _server_credentials(config: ServerConfig) -> grpc.ServerCredentials:
    """TLS for TCP listeners; with tls_client_ca, clients must present a certificate it
    signed (the handshake fails otherwise, before any call)."""
    with open(config.tls_key, "rb") as k, open(config.tls_cert, "rb") as c:
        pair = (k.read(), c.read())
    if not config.tls_client_ca:
        return grpc.ssl_server_credentials([pair])
    with open(config.tls_client_ca, "rb") as ca:
        return grpc.ssl_server_credentials([pair], root_certificates=ca.read(),
                                           require_client_auth=True)


def create_server(config: ServerConfig, wait_ready: bool = True
                  ) -> tuple[HiCacheServer, list[str]]:
    """Build and start a daemon; returns it and the addresses it is bound to, by default once
    its declared pools are built (the listeners and health answer before that)."""
    server = HiCacheServer(config)
    bound = server.start()
    if wait_ready:
        server.wait_ready()
    return server, bound
