#!/usr/bin/env bash
# Fetches the wheels that scripts/gpu_check.sh installs on a GPU machine without a package
# registry (scripts/gpu/wheels.txt: Python 3.12, x86-64 manylinux) into DEST (default .whl,
# which git ignores). Run where a registry is reachable. Usage: bash scripts/gpu_wheels.sh [DEST]
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.whl}"
mkdir -p "$dest"
mapfile -t wanted < <(sed -e 's/#.*//' -e 's/[[:space:]]*$//' scripts/gpu/wheels.txt | grep -v '^$')
platforms=()
for p in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 \
         manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${p}_x86_64")
done
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platforms[@]}" -d "$dest" "${wanted[@]}"
# what is there and nothing else: a wheel left from an older set would be installed too
python3 - "$dest" "${wanted[@]}" <<'PY'
import re, sys
from pathlib import Path
dest, wanted = Path(sys.argv[1]), sys.argv[2:]
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
want = {norm(w.split("==")[0]): w.split("==")[1] for w in wanted}
for whl in sorted(dest.glob("*.whl")):
    name, version = whl.name.split("-")[:2]
    if want.get(norm(name)) != version:
        print(f"removing {whl.name}: not in scripts/gpu/wheels.txt")
        whl.unlink()
have = {norm(w.name.split("-")[0]) for w in dest.glob("*.whl")}
missing = sorted(set(want) - have)
if missing:
    sys.exit(f"not fetched: {missing}")
size = sum(w.stat().st_size for w in dest.glob("*.whl"))
print(f"{len(have)} wheels, {size / 2**20:.1f} MiB in {dest}")
PY
