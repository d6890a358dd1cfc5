"""A process that imports vLLM's code once and forks one engine process per scenario.

Importing hicache_vllm's spec and connector and ``tests.scenarios_vllm`` (vLLM's offloading and
connector modules, torch) takes about 9 s of CPU; a test that runs a scenario in a new
interpreter pays it every time. This process pays it once: then, single-threaded, it reads one
request per line on stdin (JSON: ``scenario``, ``args``, ``out``, ``err``: files for the
engine's stdout and stderr), forks, and the child runs the scenario exactly as ``python -m
tests.vllm_harness`` would (its own process, memory, threads, sockets and exit code; nothing of
one scenario reaches the next). The zygote answers ``PID <pid>`` when the child started and
``EXIT <pid> <code>`` when it ended (``-N``: killed by signal N). ``tests.vllm_runs.run`` talks
to it.
"""

from __future__ import annotations

import json
import os
import sys


def _child(request: dict[str, object]) -> None:
    from tests.vllm_harness import run_scenario

    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, request["out"]), (2, request["err"])):
        f = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    args = request["args"]
    assert isinstance(args, dict)
    run_scenario(str(request["scenario"]), args)


def main() -> None:
    import threading

    # vLLM's connector and offloading modules, what every child's engine loads
    import hicache_vllm.connector
    import hicache_vllm.spec  # noqa: F401
    from tests import scenarios_vllm  # noqa: F401  (the import every child shares)

    assert threading.active_count() == 1, "a thread at fork time would be lost in the child"
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                _child(request)
            except BaseException:  # before its own stderr: into the zygote's
                import traceback

                traceback.print_exc()
                sys.stderr.flush()
            finally:
                os._exit(1)
        print(f"PID {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"EXIT {pid} {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    main()
