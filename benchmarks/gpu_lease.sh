#!/usr/bin/env bash
# The GPU check in a lease of 15 device-minutes, as two calls of the lent machine's `run`
# (each at most 10 minutes), made back to back so the machine stays warm between them:
#
#   GSPO_COMMIT=<sha> bash benchmarks/gpu_lease.sh 1   # numerics: the whole suite, the CUDA
#                                                      # tests in it (~5-7 min)
#   GSPO_COMMIT=<sha> bash benchmarks/gpu_lease.sh 2   # speed: gspo vs TRL on the ~0.5B/512
#                                                      # workload (and compiled), the head,
#                                                      # the three others, decoding
#
# with `.whl` (from `make gpu-wheels`) carried beside the tree. Part 1 first: the numerics
# and the suite matter before speed. Give each call a `timeout_s` 45 s or more beyond its
# budget (part 1: 490; part 2: what is left, 365 or more): a call cut at its timeout returns
# nothing, where a part that stops itself returns what it finished. Each part writes report.md, report.json and the logs
# (logs.tar.gz) into $OUT (what comes back from the machine) after every stage, so a part
# cut off at its limit still returns what it finished. The stages and budgets: `LEASE` in
# gpu_check.py. Further arguments go to gpu_check.py (`--smoke`: toy sizes, a check of this
# script here; `--stages precision`: the bf16 probe; `--gspo-set KEY=VALUE`: more
# overrides of the gspo runs).
set -o pipefail
part=${1:?usage: gpu_lease.sh 1|2}
out=${OUT:-runs/gpu_lease}
mkdir -p "$out"
# the wheels are for the device's Python 3.12 (`make gpu-wheels`); elsewhere they are left out
if [ -d .whl ] && python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
    # once per machine: a warm machine's part 2 keeps part 1's install
    stamp=/tmp/site/.wheels-$(md5sum .whl/*.whl | md5sum | cut -c1-12)  # (their contents)
    if [ ! -e "$stamp" ]; then
        rm -rf /tmp/site
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target /tmp/site .whl/*.whl || exit 1
        # byte-compiled on all cores (pip's own compiling is serial), as a user's install is:
        # else each timed run compiles what it imports (1.1 s of the trainer's build at
        # 887befd), and TRL's side, which imports more, more
        python3 -m compileall -q -j 0 /tmp/site > /dev/null || true
        touch "$stamp"
    fi
    export PYTHONPATH=/tmp/site:src
else
    export PYTHONPATH=src
fi
export PYTHONUNBUFFERED=1
# (the machine returns at most 8 files: these logs travel in $out/logs.tar.gz, which
# gpu_check.py packs from /tmp/gpu_check/logs after every stage)
rm -rf /tmp/gpu_check/logs && mkdir -p /tmp/gpu_check/logs  # (this part's logs only)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
    > /tmp/gpu_check/logs/gpu.txt 2>&1
python3 benchmarks/gpu_check.py --lease "$part" --out /tmp/gpu_check --report-dir "$out" \
    "${@:2}" 2>&1 | tee /tmp/gpu_check/logs/console.log
status=$?
# once more with the whole console (and whatever came after the last stage)
tar czf "$out/logs.tar.gz" -C /tmp/gpu_check/logs . || true
exit $status
