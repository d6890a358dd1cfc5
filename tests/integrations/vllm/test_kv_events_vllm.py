"""The daemon's KV event stream read with each vLLM release's own decoder: ``vllm.distributed.
kv_events.KVEventBatch``, imported in a process of its own with ``VLLM_TARGET_DEVICE=cpu``
from the directory the test set-up installs that release's code into (``.vllm-<release>``,
never the environment: SGLang changes its paths when it finds vLLM installed). Every message a real
daemon sent for stores with tokens, an eviction, a removal and a clear decodes there to the
same events SGLang's decoder reads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import torch
import zmq
from sglang.srt.disaggregation.kv_events import KVEventBatch

from tests.daemon_proc import start_daemon
from tests.kv_event_follower import END
from tests.kv_event_workers import PS, SPEC, Worker, chain, kv_args
from tests.vllm_runs import CORE, vllm_dir

DECODE = """
import json, sys
import msgspec
from vllm.distributed.kv_events import KVEventBatch
decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
out = []
for line in sys.stdin:
    batch = decoder.decode(bytes.fromhex(line.strip()))
    out.append([[type(e).__name__, msgspec.to_builtins(e)] for e in batch.events])
print(json.dumps(out))
"""


def everything(replay_endpoint: str) -> list[bytes]:
    """Every message the daemon sent, as the replay socket gives them (from sequence 0)."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(replay_endpoint)
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        out: list[bytes] = []
        while True:
            assert sock.poll(5000)
            _, _, seq, payload = sock.recv_multipart()
            if seq == END:
                return out
            out.append(payload)
    finally:
        sock.close()


@CORE
def test_vllms_decoder_reads_what_sglangs_reads(tmp_path: Path, vllm: str) -> None:
    d = start_daemon(tmp_path, *kv_args(tmp_path))
    w = Worker(d)
    try:
        a, tokens = chain(21, 6)
        b, _ = chain(22, 4)
        steps = [lambda: w.store(a[:3], tokens[:3 * PS]),
                 lambda: w.store(a[3:], tokens[3 * PS:], parent=a[2]),
                 lambda: w.store(b),  # evicts two
                 lambda: w.client.remove_keys(SPEC.name, b[:1]),
                 lambda: w.client.clear_pool(SPEC.name)]
        for step in steps:  # a message each (events of a few ms are published together)
            step()
            time.sleep(0.1)
        time.sleep(0.5)
        payloads = everything(f"ipc://{tmp_path}/kv-replay.sock")
    finally:
        w.close()
        d.stop()
    got = subprocess.run(
        [sys.executable, "-c", DECODE], input="\n".join(p.hex() for p in payloads),
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": str(vllm_dir(vllm)), "VLLM_TARGET_DEVICE": "cpu"})
    assert got.returncode == 0, got.stderr[-3000:]
    theirs = json.loads(got.stdout)
    sglang = msgspec.msgpack.Decoder(type=KVEventBatch)
    ours = [[[type(e).__name__, msgspec.to_builtins(e)] for e in sglang.decode(p).events]
            for p in payloads]
    assert len(theirs) == len(ours) >= 4
    kinds = [name for batch in theirs for name, _ in batch]
    assert {"AllBlocksCleared", "BlockStored", "BlockRemoved"} <= set(kinds)
    for vb, sb in zip(theirs, ours, strict=True):
        for (vname, vev), (sname, sev) in zip(vb, sb, strict=True):
            assert vname == sname
            for field in ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                          "medium"):
                assert vev.get(field) == sev.get(field), (vname, field)


@CORE
def test_lookahead_tokens_reach_vllm_034s_decoder_and_every_decoder_reads_the_messages(
        tmp_path: Path, vllm: str) -> None:
    """Stores that give the tokens after each page (vLLM 0.34's lookahead block hashes) and
    one that does not: each release's own decoder reads ``lookahead_token_ids``, one list per
    block hash, where they were given and None where not (0.33's ``BlockStored`` has the
    field too, for its own GPU blocks: it keeps the legacy hashes under any KV connector);
    SGLang's, which has no such field, reads every message all the same (the field is left
    out where there are none, and a decoder skips the fields it does not know)."""
    d = start_daemon(tmp_path, *kv_args(tmp_path))
    w = Worker(d)
    rows = [[900 + i] for i in range(5)]  # 1 token after each page (EAGLE's)
    try:
        a, tokens = chain(23, 5)
        w.session.store(a[:3], torch.arange(3 * PS), token_ids=tokens[:3 * PS],
                        lookahead_token_ids=rows[:3])
        time.sleep(0.1)
        w.session.store(a[3:], torch.arange(2 * PS), token_ids=tokens[3 * PS:],
                        parent_key=a[2])  # without
        time.sleep(0.5)
        payloads = everything(f"ipc://{tmp_path}/kv-replay.sock")
    finally:
        w.close()
        d.stop()
    got = subprocess.run(
        [sys.executable, "-c", DECODE], input="\n".join(p.hex() for p in payloads),
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": str(vllm_dir(vllm)), "VLLM_TARGET_DEVICE": "cpu"})
    assert got.returncode == 0, got.stderr[-3000:]
    stored = [ev for batch in json.loads(got.stdout) for name, ev in batch
              if name == "BlockStored"]
    sglang = msgspec.msgpack.Decoder(type=KVEventBatch)
    theirs = [e for p in payloads for e in sglang.decode(p).events
              if type(e).__name__ == "BlockStored"]
    assert [e["block_hashes"] for e in stored] == [e.block_hashes for e in theirs]
    assert len(stored) == 2 and [e["token_ids"] for e in stored] == [
        tokens[:3 * PS].tolist(), tokens[3 * PS:].tolist()]
    # (to_builtins leaves out a field at its default, as the daemon does)
    assert [e.get("lookahead_token_ids") for e in stored] == [rows[:3], None]
