"""A worker process's side of the KV event tests: pools, chains of SGLang page keys, the
daemon's KV event flags, and a worker that stores and loads over real shared memory.

Primitives: ``PS``, ``SPEC``, ``OTHER`` (two pools of 8 pages); ``sglang_hash(key)`` (SGLang's
block hash of a key); ``chain(seed, pages)`` (keys and tokens as SGLang names them);
``kv_args(tmp, *extra, config)`` (``hicached serve`` flags for the event and replay
endpoints); ``pool_stream_args(tmp)`` / ``pool_streams(daemon)`` (each pool's own stream:
the flags, and where ``GetPool`` says each is); ``Worker(daemon, spec)``: ``store``, ``load``,
``close``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from sglang.srt.mem_cache.utils import hash_str_to_int64

from hicache import DType, KVGeometry, Layout, PoolKind, PoolSpec
from hicache.keys import sglang_page_keys
from hicache_client import HiCacheClient, ShmDeviceBuffers
from tests.daemon_proc import DaemonProc

PS = 4
SPEC = PoolSpec("kv-a", KVGeometry(PoolKind.MHA, DType.BFLOAT16, 2, 1, 8), PS,
                Layout.PAGE_FIRST, size_tokens=8 * PS)  # 8 pages
OTHER = PoolSpec("kv-b", SPEC.geometry, PS, Layout.PAGE_FIRST, size_tokens=8 * PS)


def sglang_hash(key: bytes) -> int:
    return int(hash_str_to_int64(key.hex()))


def chain(seed: int, pages: int) -> tuple[list[bytes], np.ndarray]:
    """Keys of ``pages`` pages of tokens, as SGLang names them, and the tokens."""
    tokens = np.random.default_rng(seed).integers(0, 32_000, pages * PS)
    return sglang_page_keys(tokens, PS), tokens


def kv_args(tmp: Path, *extra: str, config: str = "") -> tuple[str, ...]:
    args = ["--kv-events-endpoint", f"ipc://{tmp}/kv.sock",
            "--kv-events-replay-endpoint", f"ipc://{tmp}/kv-replay.sock", *extra]
    if config:
        (tmp / "kv.toml").write_text(config)
        args += ["--config", str(tmp / "kv.toml")]
    return tuple(args)


def pool_stream_args(tmp: Path) -> tuple[str, ...]:
    """``hicached serve`` flags for a KV event stream per pool, under ``tmp/ev`` (made 0700:
    a directory no other user may write in)."""
    (tmp / "ev").mkdir(mode=0o700, exist_ok=True)
    return ("--kv-events-pool-endpoint", f"ipc://{tmp}/ev/{{pool}}",
            "--kv-events-pool-replay-endpoint", f"ipc://{tmp}/ev/{{pool}}.replay")


def pool_streams(d: DaemonProc) -> dict[str, tuple[str, str]]:
    """Each pool's own stream, as ``GetPool`` tells: name -> (endpoint, replay endpoint)."""
    with HiCacheClient(d.target) as c:
        return {p.spec.name: (p.kv_events_endpoint, p.kv_events_replay_endpoint)
                for p in c.list_pools()}


class Worker:
    def __init__(self, d: DaemonProc, spec: PoolSpec = SPEC) -> None:
        self.client = HiCacheClient(d.target)
        self.client.create_pool(spec)
        self.bufs = ShmDeviceBuffers.create(spec, device_tokens=16 * PS, sealed=True)
        self.session = self.client.open_session(spec.name, "w", self.bufs.descriptors,
                                                fds=self.bufs.fds)

    def store(self, keys: list[bytes], tokens: np.ndarray | None = None,
              parent: bytes = b"") -> int:
        r = self.session.store(keys, torch.arange(0, len(keys) * PS), token_ids=tokens,
                               parent_key=parent)
        return r.stored

    def load(self, keys: list[bytes]) -> None:
        self.session.load_keys(keys, torch.arange(0, len(keys) * PS))

    def close(self) -> None:
        self.session.close()
        self.bufs.close()
        self.client.close()
