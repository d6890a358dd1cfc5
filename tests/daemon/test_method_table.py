"""One call, defined once: the method table against the service and both front ends' codecs.

The table (``hicached.service.calls.METHODS``) must name every RPC of the proto's service; each
method the fast path carries needs a codec on both front ends; the codecs must turn what the
client sends into the typed request the handler reads, and the handler's result into what the
client decodes, on both front ends alike.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hicache import fast_wire as w
from hicache.buffers import DeviceBufferSpec
from hicache.indices import PageIds
from hicache.pools import PoolInfo
from hicache.specs import DType, KVGeometry, PoolKind, PoolSpec, Role
from hicache.v1 import hicache_pb2 as pb
from hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicache_client import fast_path as cfp
from hicached.copy.engine import Op, TransferResult
from hicached.frontends import fast_codec, grpc_codec
from hicached.frontends.grpc_service import HostCacheServicer
from hicached.service import calls

SERVICE = pb.DESCRIPTOR.services_by_name["HostCache"]


def test_the_table_names_every_rpc_of_the_service_and_nothing_else() -> None:
    assert set(calls.METHODS) == {m.name for m in SERVICE.methods}


def test_each_method_has_a_codec_on_every_front_end_that_serves_it() -> None:
    fast_names = {c.name for c in fast_codec.CODECS.values()}
    for m in calls.METHODS.values():
        assert m.name in grpc_codec.CODECS, f"{m.name}: no gRPC codec"
        if not m.grpc_only:
            assert m.name in fast_names, f"{m.name}: on the fast path, but no fast codec"
        else:
            assert m.name not in fast_names, f"{m.name}: gRPC-only, yet a fast codec"
    assert set(grpc_codec.CODECS) == set(calls.METHODS)
    assert {int(x) for x in w.Method} == set(fast_codec.CODECS), \
        "every method number of the framing has a codec"
    assert len(fast_names) == len(fast_codec.CODECS), "one number per method"


def test_the_servicer_serves_every_rpc() -> None:
    """No method falls through to the generated base class (UNIMPLEMENTED)."""
    servicer = HostCacheServicer(daemon=None)  # type: ignore[arg-type]
    for m in SERVICE.methods:
        got = getattr(servicer, m.name)
        base = getattr(pb_grpc.HostCacheServicer, m.name)
        assert getattr(got, "__func__", got) is not base, f"{m.name} is not served"


def test_a_server_stream_is_a_grpc_control_call() -> None:
    for bad in ({"data": True}, {"creates_work": True}, {"grpc_only": False}):
        with pytest.raises(ValueError):
            calls.Method("X", calls.NoRequest, calls.Done, calls.ping, stream=True,
                         **bad)  # type: ignore[arg-type]
    assert [m.name for m in calls.METHODS.values() if m.stream] == ["WatchEvents"]


# -- the codecs against what the client sends and reads --------------------------------------

KEYS = [bytes([i]) * 32 for i in range(3)]
PAGES = np.array([4, 7, 9], dtype=np.int64)


def _fast(method: w.Method, parts: list[bytes], flags: int) -> object:
    codec = fast_codec.CODECS[method]
    return codec.decode(w.Reader(b"".join(parts)), flags, 1000)


def _same(a: object, b: object) -> bool:
    if isinstance(a, PageIds):
        a = a.ids
    if isinstance(b, PageIds):
        b = b.ids
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        return all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.parametrize("touch", [False, True])
@pytest.mark.parametrize("hold_ms", [0, 250])
def test_a_lookup_decodes_alike_on_both_front_ends(hold_ms: int, touch: bool) -> None:
    flags = (w.FLAG_HOLD if hold_ms else 0) | (w.FLAG_TOUCH if touch else 0)
    fast = _fast(w.Method.LOOKUP, cfp.lookup_body("p", "sid", KEYS, hold_ms), flags)
    grpc = grpc_codec.CODECS["Lookup"].decode(
        pb.LookupRequest(pool="p", keys=KEYS, session_id="sid", hold_ms=hold_ms, touch=touch))
    assert fast == grpc == calls.LookupRequest("p", KEYS, "sid", hold_ms, touch)
    result = calls.LookupResult(2, b"\x01\x03\x00", 2, 1 if hold_ms else 0,
                                2 if hold_ms else 0)
    fast_codec_ = fast_codec.CODECS[w.Method.LOOKUP]
    got = cfp.decode_lookup(fast_codec_.encode(result, flags), bool(hold_ms))
    assert (got.hit_prefix, got.tiers, got.hits, got.held) == tuple(result)[:4]
    assert got.promise == -1  # not asked: a daemon from before would not say
    asked = cfp.decode_lookup(fast_codec_.encode(result, flags | w.FLAG_PROMISE),
                              bool(hold_ms), True)
    assert (asked.held, asked.promised) == ((1, 2) if hold_ms else (0, 0))
    msg = grpc_codec.CODECS["Lookup"].encode(result)
    assert (msg.hit_prefix, msg.tiers, msg.hits, msg.held, msg.promised) == tuple(result)
    got = client_codecs.CODECS["Lookup"].from_grpc(msg)
    assert (got.held, got.promised) == ((1, 2) if hold_ms else (0, 0))


@pytest.mark.parametrize("chain", [False, True])
@pytest.mark.parametrize("deadline", [0, 1_800_000_000_000_000_000])
def test_a_store_decodes_alike_on_both_front_ends(chain: bool, deadline: int) -> None:
    tokens = np.arange(3 * 16, dtype=np.int64)
    parent = b"\x09" * 32 if chain else b""
    flags = (w.FLAG_CHAIN if chain else 0) | (w.FLAG_DEADLINE if deadline else 0)
    fast = _fast(w.Method.STORE, cfp.keyed_body(
        "sid", KEYS, PAGES, (0, 0), deadline, (parent, tokens) if chain else None), flags)
    rows = (PAGES[:, None] * 16 + np.arange(16)).ravel()
    grpc = grpc_codec.CODECS["Store"].decode(pb.StoreRequest(
        session_id="sid", keys=KEYS, device_indices=rows.astype("<i8").tobytes(),
        token_ids=tokens.tolist() if chain else (), parent_key=parent,
        deadline_unix_ns=deadline))
    assert isinstance(fast, calls.StoreRequest) and isinstance(grpc, calls.StoreRequest)
    assert _same(fast.device, PAGES) and _same(grpc.device, rows)  # page ids / token rows
    for f in ("session_id", "keys", "layers", "parent_key", "deadline_ns"):
        assert getattr(fast, f) == getattr(grpc, f), f
    # the fast path's tokens are the frame's int64 bytes, gRPC's the message's list: one chain
    if chain:
        assert isinstance(fast.token_ids, bytes)
        assert _same(np.frombuffer(fast.token_ids, "<i8"), grpc.token_ids)
    else:
        assert fast.token_ids is None and not grpc.token_ids
    result = calls.StoreResult(1, 1, 1, bytes([1, 2, 3]), 4096, 0.25)
    got = cfp.decode_store(fast_codec.CODECS[w.Method.STORE].encode(result, flags))
    assert (got.stored, got.already_present, got.no_space, got.status, got.bytes_moved,
            got.duration_seconds) == tuple(result)
    msg = grpc_codec.CODECS["Store"].encode(result)
    assert (msg.stored, msg.already_present, msg.no_space, msg.status, msg.bytes_moved,
            msg.duration_seconds) == tuple(result)


@pytest.mark.parametrize("events", [False, True])
def test_transfers_decode_alike_on_both_front_ends(events: bool) -> None:
    flags = (w.FLAG_LAYER_EVENTS if events else 0) | w.FLAG_DEADLINE
    completion = pb.COMPLETION_LAYER_EVENTS if events else pb.COMPLETION_WAIT
    keyed = _fast(w.Method.LOAD_KEYS, cfp.keyed_body("sid", KEYS, PAGES, (1, 3), 77), flags)
    assert isinstance(keyed, calls.LoadKeysRequest)
    g = grpc_codec.CODECS["LoadKeys"].decode(pb.LoadKeysRequest(
        session_id="sid", keys=KEYS, device_indices=PAGES.astype("<i8").tobytes(),
        layer_begin=1, layer_end=3, completion=completion, deadline_unix_ns=77))
    assert _same(keyed, calls.LoadKeysRequest("sid", KEYS, PAGES, (1, 3), events, 77))
    assert _same(g, calls.LoadKeysRequest("sid", KEYS, PAGES, (1, 3), events, 77))
    for number, name in ((w.Method.BACKUP, "Backup"), (w.Method.LOAD, "Load")):
        raw = _fast(number, cfp.raw_body("sid", PAGES, PAGES[::-1], (0, 2), 5), flags)
        g = grpc_codec.CODECS[name].decode(pb.TransferRequest(
            session_id="sid", host_indices=PAGES.astype("<i8").tobytes(),
            device_indices=PAGES[::-1].astype("<i8").tobytes(), layer_begin=0, layer_end=2,
            completion=completion, deadline_unix_ns=5))
        want = calls.TransferRequest("sid", PAGES, PAGES[::-1], (0, 2), events, 5)
        assert _same(raw, want) and _same(g, want), name
    result = TransferResult(Op.LOAD, 1 << 20, 3, 0.001, 0.002, pending=events)
    got = cfp.decode_transfer(fast_codec.CODECS[w.Method.LOAD].encode(result, flags))
    assert (got.bytes_moved, got.pages, got.pending) == (1 << 20, 3, events)
    assert got.duration_seconds == pytest.approx(0.003)
    msg = grpc_codec.CODECS["Load"].encode(result)
    assert (msg.bytes_moved, msg.pages, msg.pending) == (1 << 20, 3, events)


def test_release_holds_and_heartbeat_decode_alike_on_both_front_ends() -> None:
    fast = _fast(w.Method.RELEASE_HOLDS, cfp.release_body("sid", KEYS), 0)
    grpc = grpc_codec.CODECS["ReleaseHolds"].decode(
        pb.ReleaseHoldsRequest(session_id="sid", keys=KEYS))
    assert fast == grpc == calls.ReleaseHoldsRequest("sid", KEYS)
    assert fast_codec.CODECS[w.Method.RELEASE_HOLDS].encode(calls.Count(7), 0) == \
        cfp.U32.pack(7)
    assert grpc_codec.CODECS["ReleaseHolds"].encode(calls.Count(7)).released == 7
    beat = _fast(w.Method.HEARTBEAT, cfp.session_body("sid"), 0)
    assert beat == grpc_codec.CODECS["Heartbeat"].decode(
        pb.HeartbeatRequest(session_id="sid")) == calls.SessionRequest("sid")


def test_a_bad_field_is_refused_by_the_codec_before_any_handler() -> None:
    """Indices that are not int64 little-endian: the same domain error on gRPC as its
    handler raised before the table (the envelope maps it)."""
    from hicache.errors import HiCacheError

    with pytest.raises(HiCacheError) as err:
        grpc_codec.CODECS["Store"].decode(pb.StoreRequest(session_id="s", keys=KEYS,
                                                          device_indices=b"\x01\x02\x03"))
    assert err.value.metadata.get("field") == "device_indices"
    with pytest.raises(HiCacheError):  # a body cut short: the fast codec says so alike
        _fast(w.Method.STORE, [b"\x00"], 0)


# -- the client's codecs against the daemon's: one request, both wires ------------------------

from hicache import calls as rq  # noqa: E402
from hicache_client import codecs as client_codecs  # noqa: E402

ROWS = (PAGES[:, None] * 16 + np.arange(16)).ravel()
"""PAGES as token indices (page size 16): what the gRPC wire carries."""


def _sample(name: str) -> tuple[object, object]:
    """(the request as gRPC carries it, as the fast path carries it) of ``name``."""
    if name == "Lookup":
        q: object = rq.LookupRequest("p", KEYS, "sid", 250, True)
        return q, q
    if name in ("Store", "Store-lookahead"):
        tokens = np.arange(3 * 16, dtype=np.int64)
        g = rq.StoreRequest("sid", KEYS, ROWS, (0, 0), tokens, b"\x05" * 32, 123)
        if name == "Store-lookahead":  # vLLM's lookahead hashes: 2 tokens after each page
            g = g._replace(lora_name="adapter", lookahead_tokens=2,
                           lookahead_token_ids=np.arange(48, 54, dtype=np.int64))
        return g, g._replace(device=PageIds(PAGES))
    if name == "LoadKeys":
        lk = rq.LoadKeysRequest("sid", KEYS, ROWS, (1, 3), True, 77)
        return lk, lk._replace(device=PageIds(PAGES))
    if name in ("Backup", "Load"):
        t = rq.TransferRequest("sid", ROWS, ROWS[::-1].copy(), (0, 2), name == "Load", 5)
        return t, t._replace(host=PageIds(PAGES), device=PageIds(PAGES[::-1].copy()))
    if name == "Heartbeat":
        h = rq.SessionRequest("sid")
        return h, h
    assert name == "ReleaseHolds"
    r = rq.ReleaseHoldsRequest("sid", KEYS)
    return r, r


FAST_NAMES = sorted(n for n, c in client_codecs.CODECS.items() if c.fast is not None)


def _ids(raw: object) -> object:
    """A Store's ids as an array: the frame's int64 bytes, the message's sequence (empty: the
    request's None)."""
    if raw is None or len(raw) == 0:  # type: ignore[arg-type]
        return None
    return np.frombuffer(raw, "<i8") if isinstance(raw, bytes) else np.asarray(raw)


@pytest.mark.parametrize("name", [*FAST_NAMES, "Store-lookahead"])
def test_what_the_client_sends_the_daemon_reads_as_the_same_request(name: str) -> None:
    """Encoded by the client's codec, decoded by the daemon's front end: the same typed
    request (``hicache.calls``) on both wires (a Store with lookahead tokens and a namespace
    too: every field of it arrives)."""
    method = name.split("-")[0]
    codec = client_codecs.CODECS[method]
    assert codec.fast is not None
    g, f = _sample(name)
    body = b"".join(codec.body(f))
    flags = codec.flags(f)
    assert bool(flags & w.FLAG_LOOKAHEAD) == (name == "Store-lookahead")
    got_fast = fast_codec.CODECS[codec.fast].decode(w.Reader(body), flags, 1000)
    if method == "Store":  # the frame's token ids come back as their int64 bytes
        got_fast = got_fast._replace(token_ids=_ids(got_fast.token_ids),
                                     lookahead_token_ids=_ids(got_fast.lookahead_token_ids))
    assert _same(got_fast, f), (got_fast, f)
    message = codec.message(g)
    wire = type(message).FromString(message.SerializeToString())
    got_grpc = grpc_codec.CODECS[method].decode(wire)
    if method == "Store":  # the wire's token ids come back as a sequence
        got_grpc = got_grpc._replace(token_ids=_ids(got_grpc.token_ids),
                                     lookahead_token_ids=_ids(got_grpc.lookahead_token_ids))
    assert _same(got_grpc, g), (got_grpc, g)


def test_a_store_s_high_flags_travel_in_the_header_s_second_flag_field() -> None:
    """``FLAG_LOOKAHEAD`` does not fit the header's flag byte: its bits go in the field that
    was always 0 (a daemon before it ignores that field), and come back whole."""
    assert w.split_flags(w.FLAG_CHAIN | w.FLAG_LOOKAHEAD) == (w.FLAG_CHAIN, 1)
    assert w.split_flags(w.FLAG_CHAIN) == (w.FLAG_CHAIN, 0)  # what an earlier client sent
    header = w.REQUEST.pack(7, 1, w.Method.STORE, *w.split_flags(w.KNOWN_FLAGS))
    *_, low, high = w.REQUEST.unpack(header)
    assert w.join_flags(low, high) == w.KNOWN_FLAGS


def test_every_method_has_a_client_codec_and_the_fast_ones_a_fast_codec() -> None:
    assert set(client_codecs.CODECS) == set(calls.METHODS)
    assert set(FAST_NAMES) == {m.name for m in calls.METHODS.values() if not m.grpc_only}
    for name in FAST_NAMES:
        fast = client_codecs.CODECS[name].fast
        assert fast is not None and fast_codec.CODECS[fast].name == name
    for name, codec in client_codecs.CODECS.items():
        assert codec.grpc == name
        # a call that changes state once is never sent twice by the client's retry
        assert codec.retry == (name not in {"DeletePool", "Alloc", "Free", "CloseSession",
                                            "OpenSession", "Drain"}), name


# -- the control calls: the client's request, the daemon's typed request, the reply --------

SPEC = PoolSpec("p", KVGeometry(PoolKind.MHA, DType.FLOAT16, 2, 1, 8), 16, size_tokens=1024)
BUFFER = DeviceBufferSpec(member="kv", role=Role.K, layer=0, shape=(16, 1, 8),
                          dtype=DType.FLOAT16, strides=(), transport="shm", path="/dev/shm/x",
                          offset=0, nbytes=4096)


def _control(name: str) -> object:
    return {
        "RemoveKeys": rq.KeysRequest("p", KEYS), "ClearPool": rq.PoolRequest("p"),
        "DeletePool": rq.PoolRequest("p"), "GetPool": rq.PoolRequest("p"),
        "ListSessions": rq.PoolRequest("p"), "Alloc": rq.AllocRequest("p", 64, "sid"),
        "Free": rq.FreeRequest("p", PAGES), "CloseSession": rq.SessionRequest("sid"),
        "CreatePool": rq.CreatePoolRequest(SPEC), "Drain": rq.DrainRequest(2.5),
        "WatchEvents": rq.WatchEventsRequest("p", 7, True), "GetInfo": rq.NoRequest(),
        "Ping": rq.NoRequest(), "ListPools": rq.NoRequest(),
    }[name]


@pytest.mark.parametrize("name", sorted(
    n for n, m in calls.METHODS.items() if m.grpc_only and n != "OpenSession"))
def test_a_control_call_reaches_the_daemon_as_the_request_the_client_made(name: str) -> None:
    q = _control(name)
    message = client_codecs.CODECS[name].message(q)
    wire = type(message).FromString(message.SerializeToString())
    got = grpc_codec.CODECS[name].decode(wire)
    assert type(got) is calls.METHODS[name].request
    if name == "WatchEvents":  # the daemon's side adds whether its watcher is there
        got = got._replace(active=q.active)  # type: ignore[attr-defined]
    assert _same(got, q), (got, q)


def test_open_session_decodes_its_buffers_only_when_asked() -> None:
    """The daemon checks who asks before it reads the buffers: the decode defers them."""
    q = rq.OpenSessionRequest("p", "w", [BUFFER], [b"e"], b"r", 500, "tok")
    message = client_codecs.CODECS["OpenSession"].message(q)
    got = grpc_codec.CODECS["OpenSession"].decode(message)
    assert callable(got.buffers)
    assert got._replace(buffers=[]) == q._replace(buffers=[])
    assert got.buffers() == [BUFFER]
    bad = pb.OpenSessionRequest(pool="p", buffers=[pb.DeviceBuffer()])  # no handle
    lazy = grpc_codec.CODECS["OpenSession"].decode(bad)  # not refused yet
    from hicache.errors import SpecInvalid

    with pytest.raises(SpecInvalid):
        lazy.buffers()


def test_control_results_read_back_as_the_client_returns_them() -> None:
    """The daemon's results encoded by its codec, read by the client's."""
    cc, gc = client_codecs.CODECS, grpc_codec.CODECS
    assert cc["RemoveKeys"].from_grpc(gc["RemoveKeys"].encode(calls.Count(5))) == 5
    assert cc["ClearPool"].from_grpc(gc["ClearPool"].encode(calls.Count(6))) == 6
    assert cc["Free"].from_grpc(gc["Free"].encode(calls.Count(2))) == 2
    assert np.array_equal(cc["Alloc"].from_grpc(gc["Alloc"].encode(PAGES)), PAGES)
    view = PoolInfo(spec=SPEC, size_tokens=1024, page_bytes=SPEC.page_bytes, keys=3,
                    busy_pages=2, cluster_puts=4)
    info = cc["GetPool"].from_grpc(gc["GetPool"].encode(view))
    assert (info.spec.name, info.keys, info.busy_pages, info.cluster_puts) == ("p", 3, 2, 4)
    raw = gc["GetPool"].encode(view)
    assert raw.pinned_pages == 2 and raw.remote_puts == 4  # deprecated names, same values
    assert [p.spec.name for p in gc["ListPools"].encode([view, view]).pools] == ["p", "p"]
    drained = gc["Drain"].encode(calls.DrainResult(3, 30.0, True))
    assert (drained.in_flight, drained.grace_seconds, drained.already_draining) == (3, 30, 1)
    assert cc["Ping"].from_grpc(gc["Ping"].encode(calls.Done())) is None


def test_what_the_daemon_returns_is_the_type_the_client_returns() -> None:
    """One definition per result: the API package's, used by the handlers and the client."""
    import hicache.calls
    import hicache.pools
    from hicache_client import results

    for name in ("LookupResult", "StoreResult"):
        ours = getattr(hicache.calls, name)
        assert getattr(results, name) is ours and calls.METHODS[name[:-6]].result is ours
    assert results.PoolInfo is hicache.pools.PoolInfo
    assert {calls.METHODS[m].result for m in ("GetPool", "CreatePool")} == {results.PoolInfo}
    assert type(cfp.decode_store(fast_codec.CODECS[w.Method.STORE].encode(
        calls.StoreResult(1, 0, 0, b"\x01", 8, 0.1), 0))) is results.StoreResult


def test_each_read_model_goes_onto_the_wire_field_by_field_under_its_own_name() -> None:
    """Sessions, the daemon's info, events and Store's result are rendered by name: every
    field of the read model has its message's field of the same name, and a value set in each
    comes through (a field the model gains and the proto lacks fails here, not in a call)."""
    from dataclasses import fields, replace

    from hicached.service.views import CudaDeviceView, EventView, InfoView, SessionView

    def sample(kind: type) -> Any:
        """One of ``kind`` with every field set to a value none of the others has."""
        values: dict[str, object] = {}
        for i, f in enumerate(fields(kind), start=3):
            t = str(f.type)
            values[f.name] = (i % 2 == 1 if t == "bool" else f"v{i}" if t == "str"
                              else f"{i}".encode() if t == "bytes" else [f"t{i}"]
                              if t == "list[str]" else [f"{i}".encode()] if t == "list[bytes]"
                              else [i] if t == "list[int]" else [] if t.startswith("list[")
                              else i)
        return kind(**values)

    def same(view: Any, msg: Any, *but: str) -> None:
        for f in fields(view):
            if f.name not in but:
                assert list(getattr(msg, f.name)) == getattr(view, f.name) if isinstance(
                    getattr(view, f.name), list) else getattr(msg, f.name) == getattr(
                    view, f.name), f.name

    info = replace(sample(InfoView), cuda_devices=[sample(CudaDeviceView)])
    msg = grpc_codec.CODECS["GetInfo"].encode(info)
    same(info, msg, "cuda_devices")
    same(info.cuda_devices[0], msg.cuda_devices[0])
    assert msg.remote_tier == msg.cluster_tier  # the deprecated name, the same value
    event = sample(EventView)
    same(event, grpc_codec._event(event))
    store = calls.StoreResult(1, 2, 3, b"\x01\x02", 4, 0.5)
    assert grpc_codec.CODECS["Store"].encode(store) == pb.StoreResponse(
        stored=1, already_present=2, no_space=3, status=b"\x01\x02", bytes_moved=4,
        duration_seconds=0.5)
    for uid in (None, 0, 1000):
        view = replace(sample(SessionView), peer_uid=uid)
        got = grpc_codec._session_of(view)
        same(view, got, "peer_uid")
        assert (got.peer_known, got.peer_uid) == (uid is not None, uid or 0)
