"""A real SGLang 0.5.23 server (``python -m sglang.launch_server``) on CPU, with the hicached
linker loaded through SGLang's unified-cache external linker, for end-to-end tests beside a
real ``hicached serve`` (tests/daemon_proc.py).

What it takes to run SGLang's HTTP server on a host without a GPU:

- ``SGLANG_USE_CPU_ENGINE=1``: SGLang's CPU paths (``--device cpu`` alone is not enough), with
  ``--attention-backend torch_native --sampling-backend pytorch --grammar-backend none``.
- Stand-ins for two packages that have no CPU wheel, loaded in every SGLang process (the
  server spawns its scheduler and detokenizer) by ``tests/sglang_server/sitecustomize.py``,
  which ``PYTHONPATH`` puts first; each is used only where the real package is missing:
  ``sgl_kernel`` (the two kernels SGLang's CPU path imports at module level, in plain torch:
  tests/sglang_server/sgl_kernel_cpu.py) and ``torchvision`` (inert modules for the imports
  of SGLang's model configs, invisible to transformers' availability probe:
  tests/sglang_server/torchvision_inert.py). Their docstrings say why.
- A model whose outputs depend on the whole prefix, so that a wrong KV page changes tokens
  and logprobs: ``model_dir`` writes a small Llama with random weights from transformers' own
  initialisation and a fixed seed (``--load-format dummy`` gives outputs that do not depend
  on the prompt). bfloat16: this CPU's float16 matmuls are ~100x slower. No tokenizer: the
  server runs with ``--skip-tokenizer-init`` and takes ``input_ids``.

Timing: ``torch_native`` attention computes every extend over the request's whole sequence
(its query is padded to the full length), so a prefix hit saves the MLP and projections of
the cached tokens but not their attention: a hit's time to first token stays well above a
GPU's, and grows with the prompt's square.

``SGLangServer`` starts the server on a free port with the README's linker config (only
``target`` in ``linker_extra_config``, plus what a test adds), waits for ``/health`` (200 once
SGLang's own warm-up request is done), logs to a file, and stops it with SIGTERM to the main
process (SGLang drains, and its scheduler closes the linker's session), then SIGKILL to the
process group so no scheduler or detokenizer outlives a test. Failures carry the tail of the
server's log. ``generate`` streams and returns the tokens, their logprobs, SGLang's
``meta_info`` (``cached_tokens_details``: ``device`` = SGLang's radix cache, ``host`` = pages
loaded through the linker) and the time to the first token.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from tests import prom

REPO = Path(__file__).resolve().parent.parent
STAND_INS = Path(__file__).resolve().parent / "sglang_server"

PAGE_SIZE = 16
MAX_TOTAL_TOKENS = 4096
# What SGLang's HTTP server imports on top of what its cache modules do (pyproject.toml's
# extra for SGLang's tests brings both): the tests skip without them, and fail under CI.
SERVER_MODULES = ("sglang", "fastapi", "uvicorn", "uvloop", "setproctitle", "xgrammar",
                  "soundfile", "multipart", "opentelemetry", "einops")

# A small Llama: ~35M parameters, 16 KiB of bfloat16 KV per token (8 layers x K and V x 512),
# a 4096-token device pool of 64 MiB: a 2048-token prefill takes about a second on 2 CPU
# cores, a load of its KV from the daemon tens of milliseconds.
LLAMA: dict[str, Any] = {
    "vocab_size": 1000, "hidden_size": 512, "intermediate_size": 2048,
    "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
    "max_position_embeddings": MAX_TOTAL_TOKENS, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}
SEED = 1234
T = TypeVar("T")


def model_dir(root: Path) -> Path:
    """``root/random-llama``: a Llama ``config.json`` and random bfloat16 weights
    (``model.safetensors``) from transformers' own initialisation with a fixed seed, written
    once (by a child process, so this process's torch RNG is untouched) and reused."""
    d = root / "random-llama"
    if not d.exists():
        tmp = root / f".random-llama-{os.getpid()}-{time.monotonic_ns()}"
        subprocess.run([sys.executable, "-m", "tests.sglang_server_harness", "build-model",
                        str(tmp)], cwd=REPO, check=True, timeout=600)
        try:
            tmp.rename(d)  # whole or not at all
        except OSError:  # another process's build got there first
            shutil.rmtree(tmp)
    return d


def _build_model(d: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA)).bfloat16()  # initialised in float32
    model.config.dtype = torch.bfloat16  # what SGLang's --dtype auto serves
    model.save_pretrained(d, safe_serialization=True)


def free_port() -> int:
    """A loopback TCP port free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def missing_server_modules() -> list[str]:
    """The modules of ``SERVER_MODULES`` that are not installed (found, not imported)."""
    return [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]


def linker_config(target: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The README's ``--unified-cache-external-linker-config`` with ``target`` (and ``extra``)
    in ``linker_extra_config``."""
    return {"linker": "HicachedLinker", "linker_module_path": "hicache_sglang.linker",
            "linker_extra_config": {"target": target, **(extra or {})}}


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` in a Prometheus page whose labels include
    ``labels`` (0 when there are none)."""
    return prom.value(text, name, 0.0, **labels)


@dataclass
class Generation:
    """One ``/generate`` request's answer."""

    output_ids: list[int]
    logprobs: list[float]  # of each output token
    meta_info: dict[str, Any]
    ttft_s: float  # request sent -> first token received (streamed)
    latency_s: float  # request sent -> last byte received

    @property
    def cached_tokens(self) -> int:
        return int(self.meta_info.get("cached_tokens") or 0)

    @property
    def host_hits(self) -> int:
        """Prompt tokens loaded through the linker (``cached_tokens_details.host``)."""
        return int((self.meta_info.get("cached_tokens_details") or {}).get("host") or 0)

    @property
    def device_hits(self) -> int:
        """Prompt tokens found in SGLang's own radix cache (``cached_tokens_details.device``)."""
        return int((self.meta_info.get("cached_tokens_details") or {}).get("device") or 0)


@dataclass
class SGLangServer:
    """One ``python -m sglang.launch_server`` on CPU with the hicached linker talking to
    ``target`` (a daemon's ``unix:`` socket); ``linker=False`` starts it without the linker.
    ``linker_extra`` adds to ``linker_extra_config``; ``args`` adds (or, later on the command
    line, overrides) server flags. Use as a context manager, or ``start()`` / ``stop()``."""

    model: Path
    target: str
    workdir: Path
    linker_extra: dict[str, Any] | None = None
    linker: bool = True
    args: Sequence[str] = ()
    env: dict[str, str] | None = None
    ready_timeout_s: float = 600.0
    port: int = 0
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)
    log_path: Path = field(default=Path(os.devnull), init=False)
    ready_s: float = field(default=0.0, init=False)  # start -> /health answered 200
    stopped: bool = field(default=False, init=False)

    # --- life cycle ---------------------------------------------------------------------

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.model),
               "--host", "127.0.0.1", "--port", str(self.port),
               "--device", "cpu", "--attention-backend", "torch_native",
               "--sampling-backend", "pytorch", "--grammar-backend", "none",
               "--skip-tokenizer-init", "--page-size", str(PAGE_SIZE),
               "--max-total-tokens", str(MAX_TOTAL_TOKENS), "--mem-fraction-static", "0.05"]
        if self.linker:
            cmd += ["--enable-unified-cache-external-linker",
                    "--unified-cache-external-linker-backend", "dynamic",
                    "--unified-cache-external-linker-config",
                    json.dumps(linker_config(self.target, self.linker_extra))]
        return [*cmd, *self.args]

    def environment(self) -> dict[str, str]:
        """The stand-ins first on ``PYTHONPATH``, then the repository (the tests' helpers); the
        linker under test is the one installed in this environment, non-editable, as a user
        has it (scripts/setup.sh); SGLang on its CPU paths; no Hugging Face hub."""
        path = [str(STAND_INS), str(REPO)]
        if os.environ.get("PYTHONPATH"):
            path.append(os.environ["PYTHONPATH"])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), SGLANG_USE_CPU_ENGINE="1",
                   PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        env.update(self.env or {})
        return env

    def start(self) -> SGLangServer:
        """Start it and wait until it serves (``ready_timeout_s``); on failure stop it and
        raise ``AssertionError`` with its log's tail."""
        assert self.proc is None, "already started"
        self.port = self.port or free_port()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / f"sglang-{self.port}-{time.monotonic_ns()}.log"
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            # a session of its own: stop() can end every process SGLang spawned
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         env=self.environment(), cwd=self.workdir,
                                         start_new_session=True)
        try:
            self._wait_ready(t0 + self.ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - t0
        return self

    def _wait_ready(self, deadline: float) -> None:
        assert self.proc is not None
        while True:
            if self.proc.poll() is not None:
                raise self.failure(f"SGLang exited with {self.proc.returncode} while starting")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (OSError, http.client.HTTPException):  # not listening yet, or 503
                pass
            if time.monotonic() > deadline:
                raise self.failure(f"SGLang not ready after {self.ready_timeout_s:.0f} s")
            time.sleep(0.5)

    def stop(self, grace_s: float = 60.0) -> int | None:
        """SIGTERM to the main process (SGLang drains; the linker closes its session), up to
        ``grace_s`` for it to exit, then SIGKILL to the whole process group. Returns the main
        process's exit status (None if it was never started)."""
        if self.proc is None:
            return None
        if self.stopped:
            return self.proc.returncode
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            self._exited(grace_s)
        # the main process is not reaped yet, so its pid still names this group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        code = self.proc.wait(30)
        self.stopped = True
        deadline = time.monotonic() + 30
        while (left := self.survivors()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"SGLang processes survived SIGKILL: {left}"
        return code

    def _exited(self, timeout: float) -> bool:
        """Whether the main process exits within ``timeout``, leaving it unreaped."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while True:
            try:
                if os.waitid(os.P_PID, self.proc.pid,
                             os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    return True
            except ChildProcessError:  # reaped already
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def survivors(self) -> list[int]:
        """Live (not zombie) processes of the server's process group."""
        if self.proc is None:
            return []
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == self.proc.pid and fields[0] not in ("Z", "X"):
                pids.append(int(stat.parent.name))
        return pids

    def __enter__(self) -> SGLangServer:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # --- diagnostics --------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 80) -> str:
        """The log's last lines, without SGLang's one-line dump of its arguments."""
        kept = [ln for ln in self.log().splitlines() if "server_args=" not in ln]
        return "\n".join(kept[-lines:])

    def explain(self, message: str) -> str:
        """``message`` and the tail of the server's log, for an assertion."""
        return f"{message}\n--- {self.log_path} (tail) ---\n{self.log_tail()}"

    def failure(self, message: str) -> AssertionError:
        return AssertionError(self.explain(message))

    # --- requests -----------------------------------------------------------------------

    def _request(self, method: str, path: str, body: dict[str, Any] | None,
                 timeout: float) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        data = b"" if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        return conn.getresponse()

    def generate(self, input_ids: Sequence[int], max_new_tokens: int = 8, *,
                 timeout: float = 600.0, **sampling: Any) -> Generation:
        """``POST /generate`` of ``input_ids``, greedy (temperature 0, EOS ignored, so it
        makes ``max_new_tokens`` tokens), streamed: ``ttft_s`` is the time to the first
        streamed token. ``sampling`` adds to ``sampling_params``."""
        body = {"input_ids": list(input_ids), "stream": True, "return_logprob": True,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                                    "ignore_eos": True, **sampling}}
        t0 = time.monotonic()
        ttft = None
        ids: list[int] = []
        logprobs: list[float] = []
        last: dict[str, Any] | None = None
        try:
            resp = self._request("POST", "/generate", body, timeout)
            if resp.status != 200:
                raise self.failure(f"/generate answered {resp.status}: "
                                   f"{resp.read()[:2000]!r}")
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[len(b"data:"):].strip()
                if payload == b"[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise self.failure(f"/generate failed: {chunk['error']}")
                new = chunk.get("output_ids") or []
                if new and ttft is None:
                    ttft = time.monotonic() - t0
                done = int(chunk.get("meta_info", {}).get("completion_tokens") or 0)
                ids = _merge(ids, new, done)
                logprobs = _merge(logprobs, [float(e[0]) for e in chunk.get(
                    "meta_info", {}).get("output_token_logprobs") or []], done)
                last = chunk
            resp.close()
        except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
            raise self.failure(f"/generate failed: {e!r}") from e
        latency = time.monotonic() - t0
        if last is None:
            raise self.failure("/generate streamed nothing")
        meta: dict[str, Any] = last["meta_info"]
        return Generation(ids, logprobs, meta, latency if ttft is None else ttft, latency)

    def flush(self, timeout: float = 120.0) -> None:
        """``POST /flush_cache``: SGLang drops its radix cache (refused while requests run)."""
        try:
            resp = self._request("POST", "/flush_cache", None, timeout)
            text = resp.read().decode(errors="replace")
        except (OSError, http.client.HTTPException) as e:
            raise self.failure(f"/flush_cache failed: {e!r}") from e
        if resp.status != 200:
            raise self.failure(f"/flush_cache answered {resp.status}: {text}")


def _merge(so_far: list[T], new: list[T], done: int) -> list[T]:
    """What a streamed chunk says of the ``done`` tokens made so far: all of them, or (with
    SGLang's incremental streaming) only the new ones."""
    return list(new) if len(new) == done else so_far + list(new)


def _main(argv: Sequence[str]) -> None:
    if len(argv) == 2 and argv[0] == "build-model":
        _build_model(Path(argv[1]))
        return
    raise SystemExit("usage: python -m tests.sglang_server_harness build-model DIR")


if __name__ == "__main__":
    _main(sys.argv[1:])
