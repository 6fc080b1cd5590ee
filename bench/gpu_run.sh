#!/usr/bin/env bash
# On the lent GPU machine (the device tool runs this in the repo's root, with .whl carried):
#   bash bench/gpu_run.sh [gpu_bench.py's arguments]
# Installs the carried wheels and the launcher (`train` on PATH) into /tmp/site, then runs the
# benchmark; its JSON lands in $OUT, which the tool brings back.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site .
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
if [ "${1:-}" = "--checkpoints" ]; then  # async against sync saves on the GPU
    exec python3 bench/checkpoint_blocking.py --gpu --out "${OUT:-bench/results}/checkpoint_blocking_gpu.json"
fi
python3 bench/gpu_bench.py "$@"
