#!/usr/bin/env bash
# On the lent GPU machine, after bench/gpu_wheels.sh here: the device tool's run, in the repo's
# root, with carry ["bench/wheels"]:
#   bash bench/gpu_run.sh [gpu_bench.py's arguments]    # every row, within one 10-minute call
#   bash bench/gpu_run.sh --checkpoints                 # async against sync saves instead
# Installs the carried wheels and the launcher (`train`) into a fresh folder in /tmp, first on
# PYTHONPATH and PATH, then runs the benchmark; its JSON and this log land in $OUT, which the
# tool brings back (bench/results/ where $OUT is unset). PYTHON3 names another interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON3:-python3}
out=${OUT:-bench/results}
mkdir -p "$out"
compgen -G "bench/wheels/*.whl" >/dev/null || {
    echo "no wheels in bench/wheels: run bench/gpu_wheels.sh where pip reaches the registry," \
        "and carry bench/wheels" >&2
    exit 1
}
site=$(mktemp -d /tmp/launcher-site.XXXXXX)
# One call, so that the launcher's bin/train and the wheels' scripts share one bin/ folder;
# its output (setuptools' warnings) only where it fails.
"$python" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
    --no-cache-dir --target "$site" bench/wheels/*.whl . >"$site.log" 2>&1 || {
    cat "$site.log" >&2
    exit 1
}
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} PATH=$site/bin:$PATH PYTHONUNBUFFERED=1
"$python" -c "import pydantic, typer, rich, yaml, psutil, safetensors, torch, launcher.cli.app" || exit 1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm \
    --format=csv,noheader | tee "$out/nvidia_smi.txt"
if [ "${1:-}" = "--checkpoints" ]; then
    exec "$python" bench/checkpoint_blocking.py --gpu --out "$out/checkpoint_blocking_gpu.json"
fi
"$python" bench/gpu_bench.py "$@" 2>&1 | tee "$out/gpu_bench.log"
