#!/usr/bin/env bash
# The GPU check in a lease of 15 device-minutes, as two calls of the lent machine's `run`
# (each at most 10 minutes), made back to back so the machine stays warm between them:
#
#   GSPO_COMMIT=<sha> bash benchmarks/gpu_lease.sh 1   # numerics and the suite: the CUDA tests,
#                                                      # the bf16 probe, the whole suite (~8 min)
#   GSPO_COMMIT=<sha> bash benchmarks/gpu_lease.sh 2   # speed: the ~0.5B/512 workload's start-up
#                                                      # and one batch profiled, gspo vs TRL
#                                                      # on it, decoding, async k=0 vs 1, the
#                                                      # bf16 demo
#
# with `.whl` (from `make gpu-wheels`) carried beside the tree. Part 1 first: the numerics
# and the suite matter before speed. Each part writes report.md, report.json and the pytest
# logs into $OUT (what comes back from the machine) after every stage, so a part cut off at
# its limit still returns what it finished. The stages and budgets: `LEASE` in gpu_check.py.
# Further arguments go to gpu_check.py (`--smoke`: toy sizes, a check of this script here;
# `--gspo-set KEY=VALUE`: more overrides of the gspo runs; part 2 sets
# rollout.cuda_graphs=true itself, `LEASE` in gpu_check.py).
set -o pipefail
part=${1:?usage: gpu_lease.sh 1|2}
out=${OUT:-runs/gpu_lease}
mkdir -p "$out"
# the wheels are for the device's Python 3.12 (`make gpu-wheels`); elsewhere they are left out
if [ -d .whl ] && python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:src
else
    export PYTHONPATH=src
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1
python3 benchmarks/gpu_check.py --lease "$part" --out /tmp/gpu_check --report-dir "$out" \
    "${@:2}" 2>&1 | tee "$out/console.log"
