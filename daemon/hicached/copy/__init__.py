"""Moving pages: copy plans, the runners that execute them, and the engine that orders a transfer.

- ``plan``: ``Side`` and ``CopyPlan`` (one component, a set of layers, page lists).
- ``native``: the one loader of the native module (CPU kernel and batched CUDA submission).
- ``cpu``: the CPU runner (native kernel, or a slow exact fallback).
- ``engine``: ``TransferEngine``: validate, verify canary, mark busy, plan, run, release, record.
- ``page_batch``: batches of page ids (the fast path's form) checked natively.

The CUDA runner lives in ``hicached.cuda``; the engine sees it as a ``PlanRunner``.
"""
