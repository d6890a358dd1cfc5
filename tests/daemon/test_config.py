from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from hicache.errors import SpecInvalid
from hicache.specs import Layout, PoolKind
from hicached.__main__ import _FLAGS, build_config
from hicached.server.config import ServerConfig, config_from_mapping, parse_size


def args(**kw: object) -> argparse.Namespace:
    names = ["config", *(flag[2:].replace("-", "_") for flag in _FLAGS)]
    base: dict[str, object] = {k: None for k in names}
    base.update(kw)
    return argparse.Namespace(**base)


def test_sizes() -> None:
    assert parse_size("64GiB") == 64 << 30
    assert parse_size("1.5 GB") == 1_500_000_000
    assert parse_size(4096) == 4096
    with pytest.raises(SpecInvalid):
        parse_size("lots")


def test_precedence_flags_over_env_over_file(tmp_path: Path) -> None:
    cfg = tmp_path / "hicached.toml"
    cfg.write_text('shm_dir = "/from/file"\nlease_seconds = 9\nmemory_budget = "1GiB"\n'
                   'grace_seconds = 3\n')
    env = {"HICACHED_LEASE_SECONDS": "7", "HICACHED_GRACE_SECONDS": "4"}
    c = build_config(args(config=str(cfg), grace_seconds="5"), env)
    assert c.shm_dir == "/from/file"          # file only
    assert c.lease_seconds == 7.0             # env beats file
    assert c.grace_seconds == 5.0             # flag beats env
    assert c.memory_budget_bytes == 1 << 30
    c = build_config(args(listen=["unix:/tmp/a.sock", "127.0.0.1:0"], insecure_tcp=True), {})
    assert c.listen == ("unix:/tmp/a.sock", "127.0.0.1:0") and c.insecure_tcp
    with pytest.raises(SpecInvalid, match="without client authentication"):
        build_config(args(listen=["127.0.0.1:0"]), {})
    c = build_config(args(listen=["127.0.0.1:0"]), {"HICACHED_INSECURE_TCP": "1"})
    assert c.insecure_tcp
    c = build_config(args(), {"HICACHED_CUDA_DRIVER": "/opt/compat/libcuda.so.1"})
    assert c.cuda_driver == "/opt/compat/libcuda.so.1"


def test_defaults_are_sane() -> None:
    c = ServerConfig()
    assert c.listen[0].startswith("unix:") and c.listen[0].endswith("hicached.sock")
    assert c.effective_budget() > 0


def test_declared_pools() -> None:
    c = config_from_mapping({"pool": [{
        "name": "llama", "kind": "MHA", "dtype": "bfloat16", "layout": "page_first",
        "page_size": 64, "layer_num": 32, "head_num": 8, "head_dim": 128, "size": "1GiB",
        "side": [{"name": "idx", "kind": "DSA_INDEXER", "layer_num": 32,
                  "index_head_dim": 128, "quant_block_size": 128}]}]})
    (p,) = c.pools
    assert p.geometry.kind is PoolKind.MHA and p.layout is Layout.PAGE_FIRST
    assert p.size_bytes == 1 << 30 and p.side_pools[0].geometry.index_head_dim == 128
    assert p.key_format.value == "digest"
    c = config_from_mapping({"pool": [{
        "name": "rows", "kind": "opaque", "layer_num": 4, "row_bytes": 96, "page_size": 16,
        "size_tokens": 1024, "key_format": "vllm"}]})
    assert c.pools[0].key_format.value == "vllm"


@pytest.mark.parametrize("bad", [
    {"bogus": 1}, {"listen": ["nonsense"]}, {"lease_seconds": 0}, {"shm_dir": "relative"},
    {"tls_cert": "/c.pem"}, {"pool": [{"name": "x"}]}, {"socket_mode": "0666"},
    {"socket_mode": 0o644}, {"lease_seconds": 90, "max_lease_seconds": 30},
    {"max_data_rpcs": -1},
    {"health_listen": ["nonsense"]}, {"auth_token_file": "/t"},
    {"tls_client_ca": "/ca.pem"},
    {"budget": {"interval_seconds": "x"}}, {"budget": {"elastic": True, "bogus": 1}},
    {"budget": {"grow_step_bytes": "lots"}}, {"budget": {"step_fraction": "a"}},
    {"budget": {"pools": [{"pools": "a", "x": 1}]}}, {"budget": {"tenants": [{"name": 1,
                                                                             "bogus": 2}]}},
    {"pool": [{"name": "x", "page_size": 16, "size_tokens": 64, "layer_num": 1,
               "head_num": 1, "head_dim": 8, "key_format": "md5"}]},
])
def test_invalid_settings(bad: dict[str, object]) -> None:
    with pytest.raises(SpecInvalid):
        config_from_mapping(bad)


@pytest.mark.parametrize("name,low,high", [
    ("lease_seconds", 0, None), ("grace_seconds", 0, None), ("memory_budget", 0, None),
    ("reserve", 0, None), ("copy_threads", 0, None), ("grpc_threads", 1, None),
    ("fast_path_spin_us", 0, 100_000), ("copy_spin_us", 0, 100_000),
    ("fast_path_body_timeout_s", 0, 3600), ("fast_path_inflight_bytes", 1 << 20, None),
    ("max_keys_per_call", 1, None), ("max_data_rpcs", 0, None), ("max_pending_rpcs", 0, None),
])
def test_a_number_out_of_its_range_is_refused_by_name(name: str, low: int,
                                                       high: int | None) -> None:
    """Each numeric setting takes its edges (but where the low end is open) and refuses a
    value past either, its error naming the setting."""
    open_low = name in ("lease_seconds", "fast_path_body_timeout_s")
    outside = [low - 1, *([] if high is None else [high + 1]), *([low] if open_low else [])]
    for value in outside:
        with pytest.raises(SpecInvalid, match=name.removesuffix("_bytes")) as err:
            config_from_mapping({name: value})
        assert err.value.metadata, (name, value)
    inside = [low + 1 if open_low else low, *([] if high is None else [high])]
    for value in inside:
        config_from_mapping({"max_watchers": 0, name: value})


def test_disk_tier_table() -> None:
    from hicached.tiers.config import DiskTierConfig

    c = config_from_mapping({"tier": {"disk": {"path": "/var/cache/hicached", "capacity": "2GiB",
                                               "spill_ahead": "64MiB", "fsync": "never"}}})
    assert c.disk == DiskTierConfig("/var/cache/hicached", 2 << 30, fsync="never",
                                    spill_ahead_bytes=64 << 20)
    assert c.disk.share(1 << 30, 4 << 30, 1 << 20) == 512  # a quarter of the budget
    for bad in ({"path": "rel", "capacity": "1GiB"}, {"path": "/x", "capacity": 0},
                {"path": "/x", "capacity": "1GiB", "fsync": "always"},
                {"path": "/x", "capacity": "1GiB", "speed": 1}, {"path": "/x"}):
        with pytest.raises(SpecInvalid):
            config_from_mapping({"tier": {"disk": bad}})
    with pytest.raises(SpecInvalid, match="unknown tiers"):
        config_from_mapping({"tier": {"tape": {}}})


def test_mooncake_tier_table() -> None:
    from hicached.tiers.mooncake_config import MooncakeTierConfig

    c = config_from_mapping({"tier": {"mooncake": {
        "master": "10.0.0.5:50051", "local_hostname": "10.0.0.7", "segment_size": "4GiB",
        "write_policy": "evict", "replicas": 2, "timeout_seconds": 1, "key_prefix": "prod"}}})
    assert c.mooncake == MooncakeTierConfig(
        "10.0.0.5:50051", "10.0.0.7", segment_bytes=4 << 30, write_policy="evict", replicas=2,
        timeout_seconds=1.0, key_prefix="prod")
    assert c.mooncake.metadata_server == "P2PHANDSHAKE" and c.mooncake.protocol == "tcp"
    ok = {"master": "m:1", "local_hostname": "h"}
    for bad in ({"master": "m:1"}, {"local_hostname": "h"}, {**ok, "master": "nohost"},
                {**ok, "protocol": "udp"}, {**ok, "write_policy": "back"},
                {**ok, "key_prefix": "a/b"}, {**ok, "key_prefix": ""}, {**ok, "replicas": 0},
                {**ok, "timeout_seconds": 0}, {**ok, "retry_seconds": 1000},
                {**ok, "segment_size": -1}, {**ok, "queue_size": 0}, {**ok, "speed": 1},
                {**ok, "floor_bytes_per_second": 0}):
        with pytest.raises(SpecInvalid):
            config_from_mapping({"tier": {"mooncake": bad}})


def test_mooncake_flags_over_the_file(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[tier.mooncake]\nmaster = "old:1"\nlocal_hostname = "h"\nreplicas = 2\n')
    c = build_config(args(config=str(f), mooncake_master="new:2"), {})
    assert c.mooncake is not None
    assert (c.mooncake.master, c.mooncake.replicas) == ("new:2", 2)


def test_table_flags_replace_one_setting_and_keep_the_rest_of_the_file(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[tier.disk]\npath = "/old"\ncapacity = "1GiB"\nfsync = "never"\n'
                 '[kv_events]\nendpoint = "ipc:///old"\nreplay_endpoint = "ipc:///r"\n')
    c = build_config(args(config=str(f), disk_path="/new", disk_capacity="",
                          kv_events_endpoint="ipc:///new"), {})
    assert c.disk is not None
    assert (c.disk.path, c.disk.capacity_bytes, c.disk.fsync) == ("/new", 1 << 30, "never")
    assert (c.kv_events.endpoint, c.kv_events.replay_endpoint) == ("ipc:///new", "ipc:///r")
    assert build_config(args(config=str(f)), {}).disk.path == "/old"  # type: ignore[union-attr]


def test_cluster_namespace_names_the_page_geometry_not_the_size() -> None:
    from hicache.specs import DType, KeyFormat, KVGeometry, PoolSpec
    from hicached.tiers.cluster import namespace

    g = KVGeometry(PoolKind.MHA, DType.BFLOAT16, 4, 2, 64)
    base = namespace(PoolSpec("m", g, 16, size_tokens=1024), "hc")
    assert base.startswith("hc/m.") and base.endswith("/")
    assert namespace(PoolSpec("m", g, 16, size_tokens=4096), "hc") == base
    for other in (PoolSpec("m", g, 32, size_tokens=1024),
                  PoolSpec("m", g, 16, Layout.PAGE_FIRST, size_tokens=1024),
                  PoolSpec("m", KVGeometry(PoolKind.MHA, DType.FLOAT16, 4, 2, 64), 16,
                           size_tokens=1024),
                  PoolSpec("n", g, 16, size_tokens=1024)):
        assert namespace(other, "hc") != base
    # a vLLM pool of OPAQUE rows is the namespace its pages had as MLA uint8 rows (a node
    # from before the kind shares them), and other widths are not
    rows = KVGeometry(PoolKind.OPAQUE, DType.UINT8, 4, row_bytes=96)
    legacy = KVGeometry(PoolKind.MLA, DType.UINT8, 4, kv_lora_rank=96)
    assert namespace(PoolSpec("v", rows, 16, size_tokens=1024), "hc") == "hc/v.4d1f0079a141/"
    assert namespace(PoolSpec("v", legacy, 16, size_tokens=1024), "hc") == "hc/v.4d1f0079a141/"
    # nor does what the keys are change it (vLLM's pools now say theirs are OffloadKeys)
    assert namespace(PoolSpec("v", rows, 16, size_tokens=1024, key_format=KeyFormat.VLLM),
                     "hc") == "hc/v.4d1f0079a141/"
    wider = KVGeometry(PoolKind.OPAQUE, DType.UINT8, 4, row_bytes=128)
    assert namespace(PoolSpec("v", wider, 16, size_tokens=1024), "hc") != "hc/v.4d1f0079a141/"


def test_copy_threads_and_spin() -> None:
    from hicached.core.system import default_copy_threads, usable_cpus

    assert default_copy_threads(3) == 3
    assert default_copy_threads(0) == max(1, min(8, usable_cpus() // 4))
    c = build_config(args(copy_spin_us="250"), {})
    assert c.copy_spin_us == 250 and c.copy_threads == 0
    for bad in (-1, 100_001):
        with pytest.raises(SpecInvalid):
            config_from_mapping({"copy_spin_us": bad})


def test_the_fast_paths_poll_window() -> None:
    """Polls up to 200 us by default (the client too), 0 turns it off, bounded."""
    import inspect

    from hicache.polling import DEFAULT_MAX_US
    from hicache_client import HiCacheClient

    assert DEFAULT_MAX_US == 200 and ServerConfig().fast_path_spin_us == DEFAULT_MAX_US
    assert inspect.signature(HiCacheClient).parameters["spin_us"].default == DEFAULT_MAX_US
    assert build_config(args(fast_path_spin_us="0"), {}).fast_path_spin_us == 0
    for bad in (-1, 100_001):
        with pytest.raises(SpecInvalid):
            config_from_mapping({"fast_path_spin_us": bad})


def test_the_cluster_tier_answers_within_the_linkers_lookup_deadline() -> None:
    """A Lookup waits on a stalled master for timeout_seconds; past the linker's deadline
    the engines' links to the daemon would go late (DEADLINE_EXCEEDED)."""
    from hicache_sglang.config import LinkerConfig
    from hicache_vllm.config import SpecConfig
    from hicached.tiers.mooncake_config import MooncakeTierConfig

    assert MooncakeTierConfig("m:1", "h").timeout_seconds < LinkerConfig().lookup_timeout_s
    assert MooncakeTierConfig("m:1", "h").timeout_seconds < SpecConfig().lookup_timeout_s


def test_the_ways_gpu_copies_may_go(tmp_path: Path) -> None:
    """dma alone by default; a flag, the environment or the file set it, comma-separated or
    as a list (one way alone forces it: the GPU check and bench_cuda.py do); never empty,
    nothing unknown."""
    assert ServerConfig().cuda_copy_paths == ("dma",)
    assert build_config(args(cuda_copy_paths=["dma,kernel"]), {}).cuda_copy_paths == \
        ("dma", "kernel")
    assert build_config(args(cuda_copy_paths=["dma", "batch"]), {}).cuda_copy_paths == \
        ("dma", "batch")
    env = {"HICACHED_CUDA_COPY_PATHS": "dma,batch,kernel"}
    assert build_config(args(), env).cuda_copy_paths == ("dma", "batch", "kernel")
    cfg = tmp_path / "h.toml"
    cfg.write_text('cuda_copy_paths = ["dma", "kernel"]\n')
    assert build_config(args(config=str(cfg)), {}).cuda_copy_paths == ("dma", "kernel")
    assert config_from_mapping({"cuda_copy_paths": "kernel"}).cuda_copy_paths == ("kernel",)
    for bad in (["dma", "zero-copy"], [], ""):
        with pytest.raises(SpecInvalid, match="cuda_copy_paths") as info:
            config_from_mapping({"cuda_copy_paths": bad})
        assert info.value.reason == "SPEC_INVALID"


def _socket_path(length: int) -> str:
    path = "/tmp/" + "d" * (length - len("/tmp/") - len("/h.sock")) + "/h.sock"
    assert len(path) == length
    return path


def test_a_socket_path_with_no_room_for_the_sockets_beside_it_is_refused_at_start() -> None:
    """Every socket beside an API socket (``.id``; ``.fast`` unless the fast path is off) must
    fit a Unix socket path's 107 bytes: the daemon refuses at start, not with a bind error
    after the gRPC server is up."""
    ok = _socket_path(107 - len(".fast"))
    assert ServerConfig(listen=(f"unix:{ok}",)).listen == (f"unix:{ok}",)
    over = _socket_path(107 - len(".fast") + 1)
    with pytest.raises(SpecInvalid) as err:
        ServerConfig(listen=(f"unix://{over}",))
    assert err.value.metadata["path_bytes"] == "108" and err.value.metadata["max_bytes"] == "107"
    assert over + ".fast" in str(err.value) and "<socket>.id and <socket>.fast" in str(err.value)
    assert ServerConfig(listen=(f"unix:{over}",), fast_path=False).fast_path is False
    with pytest.raises(SpecInvalid, match=r"\.id"):
        ServerConfig(listen=(f"unix:{_socket_path(107 - len('.id') + 1)}",), fast_path=False)
    with pytest.raises(SpecInvalid, match="over the 107"):
        ServerConfig(health_listen=(f"unix:{_socket_path(108)}",))
    huge = "unix:/tmp/" + "x" * 100_000
    with pytest.raises(SpecInvalid) as err:
        ServerConfig(listen=(huge,))
    assert len(str(err.value)) < 1000 and len(err.value.metadata["listen"]) <= 200


def test_serve_with_a_socket_path_too_long_exits_2_saying_why(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hicached.__main__ import main

    over = _socket_path(104)
    assert main(["serve", "--listen", f"unix:{over}", "--state-dir", "",
                 "--shm-dir", str(tmp_path), "--metrics-listen", ""]) == 2
    err = capsys.readouterr().err
    assert "over the 107" in err and "Traceback" not in err
