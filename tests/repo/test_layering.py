"""The layering shows at run time too: what importing each side loads.

(Modules are split by role, never by line count: the old 400-line rule made mixins that share
private state, and is gone.)"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.daemon_proc import REPO


def loaded_after(statement: str) -> dict[str, str]:
    """Module name -> file of every module a fresh interpreter has loaded after ``statement``."""
    code = (f"{statement}\nimport json, sys\n"
            "print(json.dumps({n: getattr(m, '__file__', None) or '' "
            "for n, m in list(sys.modules.items())}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    loaded: dict[str, str] = json.loads(out.stdout.splitlines()[-1])
    return loaded


def ours_native(loaded: dict[str, str]) -> list[str]:
    return [n for n, f in loaded.items()
            if n.split(".")[0] in ("hicache", "hicached", "hicache_client")
            and f.endswith(".so")]


def test_the_worker_client_loads_no_daemon_module_and_no_native_extension() -> None:
    loaded = loaded_after("import hicache_client")
    assert "hicache_client.client" in loaded  # the import did happen
    assert [n for n in loaded if n == "hicached" or n.startswith("hicached.")] == []
    assert ours_native(loaded) == []
    assert "torch" not in loaded, "torch is imported when a worker makes tensors, not before"


def test_the_api_package_loads_neither_grpc_nor_torch() -> None:
    loaded = loaded_after("import hicache, hicache.specs, hicache.errors, hicache.buffers")
    assert not {"grpc", "torch", "google.protobuf", "hicache.cuda_driver"} & set(loaded)


def test_the_core_loads_no_grpc_no_protobuf_no_cuda_driver() -> None:
    loaded = loaded_after("import hicached.core.pool, hicached.copy.engine")
    forbidden = {"grpc", "google.protobuf", "hicache.v1", "hicache.cuda_driver", "hicached.cuda",
                 "hicached.server", "hicached.transport"}
    assert not forbidden & set(loaded)


def test_the_application_loads_no_grpc_and_no_front_end() -> None:
    loaded = loaded_after("import hicached.service.daemon, hicached.service.pool_table")
    assert "hicached.service.daemon" in loaded
    forbidden = {"grpc", "google.protobuf", "hicache.v1", "hicached.frontends",
                 "hicached.server"}
    below = tuple(f + "." for f in forbidden)
    assert [n for n in loaded if n in forbidden or n.startswith(below)] == []


def _cycles(adjacency: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in adjacency:
        if root in index:
            continue
        work = [(root, iter(adjacency[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, edges = work[-1]
            for w in edges:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(adjacency[w])))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_module_imports_one_that_imports_it_back() -> None:
    """No import cycle among our modules, counting lazy imports and those made only for type
    checking: a cycle is two modules that are one (``allocator`` and its checker read each
    other's state; the client and its session each named the other)."""
    import grimp

    graph = grimp.build_graph("hicached", "hicache_client", "hicache", "hicache_sglang",
                              "hicache_vllm")
    ours = set(graph.modules)
    adjacency = {m: sorted(x for x in graph.find_modules_directly_imported_by(m) if x in ours)
                 for m in sorted(ours)}
    assert len(adjacency) > 100
    assert _cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert not _cycles(adjacency)


def test_no_test_module_imports_another() -> None:
    """What several test modules share lives in helper modules of tests/ (fixtures, workers,
    harnesses); a test module is never imported by another, not even by a script it runs in
    a child process (such an import runs the other module's collection-time code and ties
    the two together)."""
    import re

    tests = REPO / "tests"
    pattern = re.compile(r"(?:from|import)\s+tests(?:\.[A-Za-z_]+)*\.test_[A-Za-z0-9_]+")
    bad = [f"{p.relative_to(REPO)}: {m.group(0)}"
           for p in sorted(tests.rglob("*.py"))
           for m in pattern.finditer(p.read_text())]
    assert not bad, bad
    helpers = [p for p in tests.rglob("*.py") if not p.name.startswith(("test_", "conftest"))]
    assert any(p.name == "mooncake_cluster.py" for p in helpers)
