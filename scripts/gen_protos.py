"""Regenerate the committed protobuf / gRPC stubs from protos/.

Usage: python scripts/gen_protos.py [--check]
--check regenerates into a temporary directory and exits 1 when the committed stubs differ.
"""

from __future__ import annotations

import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
OUT = ROOT / "clients" / "python"
FILES = ["hicache/v1/hicache.proto"]
GENERATED = ["hicache_pb2.py", "hicache_pb2.pyi", "hicache_pb2_grpc.py"]


def generate(out: Path) -> None:
    for f in FILES:
        rc = protoc.main([
            "grpc_tools.protoc", f"-I{PROTOS}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", str(PROTOS / f),
        ])
        if rc != 0:
            raise SystemExit(f"protoc failed on {f}")


def main() -> int:
    if "--check" in sys.argv:
        with tempfile.TemporaryDirectory() as tmp:
            generate(Path(tmp))
            stale = [g for g in GENERATED if not filecmp.cmp(
                Path(tmp) / "hicache/v1" / g, OUT / "hicache/v1" / g, shallow=False)]
        if stale:
            print(f"generated stubs are stale: {stale}; run python scripts/gen_protos.py")
            return 1
        print("generated stubs match protos/")
        return 0
    generate(OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
