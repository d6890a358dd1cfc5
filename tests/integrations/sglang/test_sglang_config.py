"""The linker's configuration, namespace and pool mapping, and the shipped command lines.

The command lines in README.md, the Kubernetes pod and the systemd unit are parsed with SGLang's
own argument parser and linker-config check, and the class they name is resolved the way
SGLang's factory resolves it.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from hicache.errors import SpecInvalid
from hicache.paths import default_target
from hicache.specs import DType, KVGeometry, PoolKind
from hicache_sglang.config import LinkerConfig
from hicache_sglang.namespace import Shard, pool_name
from tests.helpers import require_module
from tests.sglang_harness import sglang_config_from_argv

REPO = Path(__file__).resolve().parents[3]
MHA = KVGeometry(PoolKind.MHA, DType.BFLOAT16, layer_num=32, head_num=8, head_dim=128)
MLA = KVGeometry(PoolKind.MLA, DType.BFLOAT16, layer_num=61, kv_lora_rank=512,
                 qk_rope_head_dim=64)


def test_config_defaults_and_overrides() -> None:
    cfg = LinkerConfig.from_extra(None)
    assert cfg.target.startswith("unix:") and cfg.lookup_timeout_s == 0.2
    assert cfg.poll_us == 200
    cfg = LinkerConfig.from_extra({"target": "unix:/s", "rpc_timeout_s": 2, "namespace": "a",
                                   "poll_us": 0})
    assert (cfg.target, cfg.rpc_timeout_s, cfg.namespace, cfg.poll_us) == ("unix:/s", 2, "a", 0)


@pytest.mark.parametrize("extra,field", [
    ({"targte": "unix:/s"}, "unknown"),
    ({"lookup_timeout_s": 0}, "lookup_timeout_s"),
    ({"rpc_timeout_s": float("nan")}, "rpc_timeout_s"),
    ({"reconnect_interval_s": True}, "reconnect_interval_s"),
    ({"pool_size_tokens": -1}, "pool_size_tokens"),
    ({"pool_size_tokens": 64, "pool_size_bytes": 1 << 20}, "pool_size_bytes"),
    ({"pool_size_ratio": 0}, "pool_size_ratio"),
    ({"pool_size_ratio": float("nan")}, "pool_size_ratio"),
    ({"pool_size_ratio": True}, "pool_size_ratio"),
    ({"max_inflight_offloads": 0}, "max_inflight_offloads"),
    ({"poll_us": -1}, "poll_us"),
    ({"poll_us": 100_001}, "poll_us"),
    ({"poll_us": 2.5}, "poll_us"),
    ({"pool_prefix": "a b"}, "pool_prefix"),
    ({"target": ""}, "target"),
])
def test_bad_config_is_refused_naming_the_field(extra, field) -> None:
    with pytest.raises(SpecInvalid) as exc:
        LinkerConfig.from_extra(extra)
    assert exc.value.reason == "SPEC_INVALID"
    assert field in str(exc.value)


def test_pool_names_separate_what_differs_and_only_that() -> None:
    base = pool_name("sgl", "meta-llama/Llama-3-8B", MHA, 64, Shard(0, 2))
    assert base.startswith("sgl-Llama-3-8B-") and base.endswith("-tp0of2-cp0-pp0")
    assert base == pool_name("sgl", "meta-llama/Llama-3-8B", MHA, 64, Shard(0, 2))
    variants = {
        pool_name("sgl", "meta-llama/Llama-3-70B", MHA, 64, Shard(0, 2)),
        pool_name("sgl", "other/Llama-3-8B", MHA, 64, Shard(0, 2)),  # same basename
        pool_name("sgl", "meta-llama/Llama-3-8B", MHA, 64, Shard(0, 2), revision="v2"),
        pool_name("sgl", "meta-llama/Llama-3-8B", MHA, 32, Shard(0, 2)),
        pool_name("sgl", "meta-llama/Llama-3-8B", MHA, 64, Shard(1, 2)),
        pool_name("sgl", "meta-llama/Llama-3-8B", MHA, 64, Shard(0, 2, pp_rank=1)),
        pool_name("sgl", "meta-llama/Llama-3-8B", MHA, 64, Shard(0, 2), namespace="t"),
        pool_name("sgl", "meta-llama/Llama-3-8B", MHA, 64, Shard(0, 2), format_tag="x"),
        pool_name("sgl", "meta-llama/Llama-3-8B",
                  KVGeometry(PoolKind.MHA, DType.UINT8, 32, 8, 128), 64, Shard(0, 2)),
    }
    assert base not in variants and len(variants) == 9
    # MLA KV is the same on every TP rank: one pool, whatever the rank or TP size
    mla = {pool_name("sgl", "deepseek-ai/DeepSeek-V3", MLA, 64,
                     Shard(r, n, replicated=True)) for r, n in ((0, 1), (0, 8), (5, 8))}
    assert len(mla) == 1 and next(iter(mla)).endswith("-tpall-cp0-pp0")
    assert Shard(0, 8, replicated=True).writer and not Shard(5, 8, replicated=True).writer
    assert Shard(5, 8).writer
    long = pool_name("p", "x/" + "a" * 300, MHA, 64, Shard())
    assert len(long) <= 128 and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-]*", long)


def _launch_argv(command: str) -> list[str]:
    argv = shlex.split(command.replace("\\\n", " "))
    start = argv.index("sglang.launch_server") + 1
    return [a.replace("${MODEL}", "m") for a in argv[start:]]


def test_readme_command_line_is_what_sglang_accepts() -> None:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Use with SGLang"):]
    block = section[section.index("```bash") + 7:section.index("```", section.index("```bash")
                                                                 + 7)]
    extra = sglang_config_from_argv(_launch_argv(block))
    # copied as it is, the linker connects where a daemon started with no flags listens
    assert LinkerConfig.from_extra(extra).target == default_target()


def test_kubernetes_pod_runs_sglang_with_the_linker_against_the_sidecar() -> None:
    pod = next(yaml.safe_load_all((REPO / "deploy/kubernetes/sidecar-pod.yaml").read_text()))
    sidecar, sglang = pod["spec"]["containers"]
    extra = sglang_config_from_argv(sglang["args"])
    sock = extra["target"].removeprefix("unix:")
    listen = [a.split("=", 1)[1] for a in sidecar["args"] if a.startswith("--listen=")]
    assert listen == [f"unix:{sock}"], "the API must not listen on the network"
    shm = next(a.split("=", 1)[1] for a in sidecar["args"] if a.startswith("--shm-dir="))
    assert extra["shm_dir"] == shm

    def mounted(container: dict[str, Any], path: str) -> str:
        return str(next(m["name"] for m in container["volumeMounts"]
                        if path.startswith(m["mountPath"])))

    for path in (sock, shm):  # both containers see the socket and the buffer files
        assert mounted(sidecar, path) == mounted(sglang, path)
    health = [a.split("=", 1)[1] for a in sidecar["args"] if a.startswith("--health-listen=")]
    for probe in ("readinessProbe", "livenessProbe"):  # on the health-only listener
        assert [f"0.0.0.0:{sidecar[probe]['grpc']['port']}"] == health


def test_systemd_unit_runs_sglang_with_the_linker() -> None:
    unit = (REPO / "deploy/systemd/sglang-hicached.service").read_text()
    exec_start = re.search(r"^ExecStart=(.*?[^\\])$", unit, re.M | re.S)
    assert exec_start is not None
    extra = sglang_config_from_argv(_launch_argv(exec_start.group(1)))
    daemon = (REPO / "deploy/hicached.toml").read_text()
    assert f'"{extra["target"]}"' in daemon and f'shm_dir = "{extra["shm_dir"]}"' in daemon


def test_device_pools_hicached_cannot_hold_are_refused_at_start() -> None:
    require_module("sglang", "sglang==0.5.23 (scripts/setup.sh --test)")
    import torch

    from hicache_sglang.device_pool import DevicePool
    from tests.sglang_harness import install_stand_ins

    install_stand_ins()
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    def mha(**kw: object) -> MHATokenToKVPool:
        return MHATokenToKVPool(size=64, page_size=4, dtype=torch.bfloat16, head_num=2,
                                head_dim=8, layer_num=2, device="cpu",
                                enable_memory_saver=False, **kw)

    pool = DevicePool.from_kvcache(mha())
    assert (pool.geometry.kind, pool.geometry.head_num, pool.size) == (PoolKind.MHA, 2, 64)
    assert pool.pool_spec("p").size_tokens == 64
    # the linker's default: pool_size_ratio (4) times the device pool, whole pages
    assert pool.pool_spec("p", ratio=LinkerConfig().pool_size_ratio).size_tokens == 256
    assert pool.pool_spec("p", ratio=0.3).size_tokens == 16  # 19.2 tokens: whole pages
    assert pool.pool_spec("p", ratio=0.01).size_tokens == 4  # at least one page
    assert pool.pool_spec("p", size_tokens=40, ratio=4).size_tokens == 40
    wide = MLATokenToKVPool(size=64, page_size=4, dtype=torch.float8_e4m3fn, kv_lora_rank=16,
                            qk_rope_head_dim=8, layer_num=2, device="cpu",
                            enable_memory_saver=False)
    g = DevicePool.from_kvcache(wide).geometry
    assert (g.dtype, g.components(4)[0].unit_shape) == (DType.UINT8, (1, 24))
    hnd = mha()
    hnd.kv_cache_layout = "hnd"
    for bad, why in ((hnd, "layout 'hnd'"), (object(), "no store_dtype")):
        with pytest.raises(SpecInvalid) as exc:
            DevicePool.from_kvcache(bad)
        assert why in str(exc.value)


REFUSED = """
import json, sys
from sglang.srt.mem_cache.unified_cache import linker_factory
try:
    linker_factory.create_unified_cache_linker(
        None, None, backend="dynamic", components=set(),
        config={"linker": "HicachedLinker", "linker_module_path": "hicache_sglang.linker",
                "linker_extra_config": {}})
except Exception as exc:
    print(json.dumps({"type": type(exc).__name__, "reason": getattr(exc, "reason", ""),
                      "metadata": getattr(exc, "metadata", {}), "message": str(exc)}))
"""


def test_an_sglang_outside_the_table_stops_where_it_loads_the_linker(tmp_path: Path) -> None:
    """SGLang 0.5.24 as a user would have it installed (its distribution's metadata first on
    the path, the code the one served): SGLang's own linker factory, loading the linker by
    the README's dotted path, stops with SPEC_INVALID naming the version and what is served,
    before the linker touches anything."""
    require_module("sglang", "sglang==0.5.23 (scripts/setup.sh --test)")
    import json
    import os
    import subprocess
    import sys

    dist = tmp_path / "site" / "sglang-0.5.24.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.24\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    out = subprocess.run([sys.executable, "-c", REFUSED], env=env, capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert (got["type"], got["reason"]) == ("SpecInvalid", "SPEC_INVALID"), got
    assert got["metadata"] == {"engine": "sglang", "installed": "0.5.24", "supported": "0.5.23"}
    assert "SGLang 0.5.24 is not served" in got["message"]
