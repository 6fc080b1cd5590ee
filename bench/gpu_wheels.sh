#!/usr/bin/env bash
# Run here, where the package registry is reachable: the launcher's dependencies that the lent
# GPU machine lacks (its image has torch 2.11 on Python 3.12, lightning, typer, rich, pyyaml,
# psutil and safetensors, but not pydantic), as wheels in .whl/, which .git/info/exclude keeps
# out of git and the device tool carries (carry: [".whl"]). There, bench/gpu_run.sh installs
# them and runs bench/gpu_bench.py.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-dir)/info/exclude
mkdir -p "$(dirname "$exclude")"
grep -qx "/.whl/" "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    platforms+=(--platform "$p")
done
# The versions .venv runs (requirements/dev.txt pins pydantic; pydantic-core matches it).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl \
    pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
ls .whl
