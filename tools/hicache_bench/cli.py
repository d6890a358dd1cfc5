"""``hicache-bench``'s entry point: ``main(argv)`` runs one command, importing only its module.

- ``hicache-bench [flags]``: ``throughput`` (needs torch);
- ``hicache-bench compare BASE``: ``compare`` (needs torch: its latency runs make tensors);
- ``hicache-bench trace TRACE.jsonl``: ``trace`` (no torch: it runs after the daemon's own
  set-up);
- ``hicache-bench soak``: ``soak`` (no torch): a daemon under a node's mix, its books sampled;
- ``hicache-bench torture``: ``torture`` (no torch): a daemon killed again and again under
  load, its crash contract checked after each restart.

A command that needs torch where the interpreter has none ends with status 2 and one line that
says what to install, before anything starts.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable

COMMANDS: dict[str, tuple[str, bool]] = {
    # first word -> (module of hicache_bench whose main(argv) runs it, whether it needs torch)
    "compare": ("compare", True),
    "trace": ("trace", False),
    "soak": ("soak", False),
    "torture": ("torture", False),
}
DEFAULT = ("throughput", True)
"""What runs when the first word is no command: the throughput run, its flags as given."""

NO_TORCH = ("needs torch (its workers' buffers are torch tensors) and this Python has none: "
            "pip install 'hicached[bench]' (on a host without a GPU, torch's CPU build "
            "instead, e.g. torch==2.13.0+cpu from a CPU wheel index)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in COMMANDS:
        name, (module, torch) = argv[0], COMMANDS[argv[0]]
        argv = argv[1:]
    else:
        name, (module, torch) = "", DEFAULT
    if torch and importlib.util.find_spec("torch") is None:
        print(f"hicache-bench{' ' + name if name else ''}: {NO_TORCH}", file=sys.stderr)
        return 2
    run: Callable[[list[str]], int] = importlib.import_module(f"hicache_bench.{module}").main
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
