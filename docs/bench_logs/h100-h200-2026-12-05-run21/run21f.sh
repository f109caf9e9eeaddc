#!/usr/bin/env bash
# Twenty-first run, call F (any Hopper): profile_swiglu.py at batch ${1:-16}, `.whl` carried.
# Logs to $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 XLA_FLAGS=--xla_gpu_enable_command_buffer=
export PYTHONPATH=/tmp/site:$PWD:$PWD/experiments:$PWD/docs/bench_logs/h100-h200-2026-12-05-run21
cd experiments
timeout ${2:-400} python ../docs/bench_logs/h100-h200-2026-12-05-run21/profile_swiglu.py ${1:-16} \
  > $OUT/f1_profile_swiglu.log 2>&1
grep -E "Error|RESOURCE" $OUT/f1_profile_swiglu.log | cut -c 1-300; grep -E "^==" $OUT/f1_profile_swiglu.log
