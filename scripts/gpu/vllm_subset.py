"""Copies the vLLM modules hicache_vllm imports (pure Python, about 3 MB) out of the test
command's newest vLLM (``.vllm-<release>``, the newest release ``hicache.engines`` tests) into
DEST (default ``.vllm-gpu``, which git ignores), for the GPU check: the GPU machine reaches no
package registry and vLLM's whole wheel is far over what travels, while the spec needs only
vLLM's offloading interfaces (``vllm.v1.kv_offload.base`` and what it imports), and the GPU
tests vLLM's pointer resolution and its extensible KV cache allocator
(``vllm.v1.kv_offload.pointer_utils``, ``vllm.utils.extensible_tensor``). vLLM's distribution
metadata comes too: the spec reads the installed version (hicache.engines) before it starts.
Usage: python3 scripts/gpu/vllm_subset.py [DEST]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROBE = """
import json, sys
import hicache_vllm.spec
import vllm.utils.extensible_tensor, vllm.v1.kv_offload.pointer_utils
mods = list(sys.modules.items())
print(json.dumps(sorted(m.__file__ for n, m in mods
                        if n.split(".")[0] == "vllm" and getattr(m, "__file__", None))))
"""


def newest() -> str:
    sys.path.insert(0, str(REPO / "clients" / "python"))
    from hicache import engines

    return engines.lines("vllm")[-1].tested


def main() -> None:
    dest = Path(sys.argv[1] if len(sys.argv) > 1 else REPO / ".vllm-gpu")
    release = newest()
    vllm = REPO / f".vllm-{release}"
    if not (vllm / ".complete").exists():
        sys.exit(f"no vLLM in {vllm} (scripts/setup.sh --test)")
    env = dict(os.environ, PYTHONPATH=f"{vllm}:{REPO / 'clients' / 'python'}",
               VLLM_TARGET_DEVICE="cpu")
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, check=True).stdout
    files = [Path(f) for f in json.loads(out.splitlines()[-1])]
    shutil.rmtree(dest, ignore_errors=True)
    size = 0
    for f in files:
        rel = f.relative_to(vllm)
        assert rel.suffix == ".py", f"{rel}: not pure Python"
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dest / rel)
        size += f.stat().st_size
    meta = Path(f"vllm-{release}.dist-info") / "METADATA"
    (dest / meta).parent.mkdir(parents=True)
    shutil.copy2(vllm / meta, dest / meta)
    print(f"{len(files)} vLLM modules, {size / 1e6:.2f} MB into {dest}")


if __name__ == "__main__":
    main()
