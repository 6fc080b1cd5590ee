#!/usr/bin/env bash
# Run here, where the package registry is reachable (`make gpu-wheels`): the launcher's
# dependencies other than torch and numpy, and torchao (train.float8), as wheels for the lent
# GPU machine (Python 3.12, x86-64, no registry), into bench/wheels/ (git ignores it; the
# device tool carries it: carry ["bench/wheels"]). There, bench/gpu_run.sh installs them and
# runs bench/gpu_bench.py.
#
# The versions are requirements/dev.txt's pins, and for what those need (pydantic-core,
# click, pygments, ...) the versions .venv runs, so the GPU machine runs what the tests ran;
# pip resolves them for the target, so pydantic-core is the one pydantic names.
#   WHEELS_PYTHON=3.11 bench/gpu_wheels.sh   # for another Python (a CPU rehearsal here)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PIP_PYTHON:-.venv/bin/python}
target=${WHEELS_PYTHON:-3.12}
dir=bench/wheels
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

# Pinned name==version lines of .venv (no local paths), to constrain the transitive ones.
"$python" -m pip freeze --exclude-editable | grep -E '^[A-Za-z0-9_.-]+==' >"$scratch/venv.txt"
grep -iE '^(pydantic|typer|rich|pyyaml|psutil|safetensors|torchao)==' requirements/dev.txt >"$scratch/pins.txt"
[ "$(wc -l <"$scratch/pins.txt")" -eq 7 ] || {
    echo "requirements/dev.txt should pin pydantic, typer, rich, PyYAML, psutil, safetensors," \
        "torchao" >&2
    exit 1
}
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
    manylinux_2_12_x86_64 manylinux2010_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
rm -rf "$dir" && mkdir -p "$dir"  # one version of each: two would stop the install there
"$python" -m pip download -q --only-binary=:all: --python-version "$target" --implementation cp \
    "${platforms[@]}" -d "$dir" -r "$scratch/pins.txt" -c "$scratch/venv.txt"
ls "$dir"
du -sh "$dir"
