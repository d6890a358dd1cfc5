"""hicache_bench: the ``hicache-bench`` tool, apart from the daemon it measures.

The daemon never imports this package (an import rule); it imports the daemon's engine only
where a baseline runs it in-process. torch is imported only by the commands whose workers make
tensors (``throughput``, ``compare``): ``trace``, ``soak`` and ``torture`` run where the
daemon's own set-up installed nothing more (``bash scripts/serve.sh``), and a command that
needs torch where there is none says so in one line (``cli``).

Modules:

- ``cli``: ``hicache-bench``'s entry point: the commands, each loaded when it runs.
- ``daemon``: ``start_daemon``: a daemon process for the tool's commands and for benchmarks/.
- ``throughput``: ``hicache-bench [flags]``: Backup / Load traffic from worker processes
  through a daemon, beside the engine's in-process copy of the same bytes.
- ``compare``: ``hicache-bench compare BASE``: the data calls' latency of a base revision
  and this tree, side by side in one run.
- ``latency``: one latency run of one source tree (``compare`` runs it as a script under
  either tree).
- ``trace``: ``hicache-bench trace TRACE.jsonl``: a request trace's prefix hit rate through
  the daemon, beside reference policies.
- ``trace_policies``: the reference caches a trace replay compares with (LRU, ARC, S3-FIFO,
  the daemon's ``reuse``, the offline optimum, the oracles).
- ``workload``: a worker process of the soak and the torture (pages whose bytes are a
  function of their key, checked wherever they are loaded).
- ``soak``: ``hicache-bench soak``: a daemon under a node's mix; does anything grow?
- ``torture``: ``hicache-bench torture``: the daemon killed under load, its crash contract
  checked after every restart.
"""
