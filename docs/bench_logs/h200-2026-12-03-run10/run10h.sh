#!/usr/bin/env bash
# Tenth H200 run, call H (no TE): the unrolled proxy-2b train step with the gradients
# materialised before the optimiser against without (bench_barrier.py), both profiled.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
cd experiments
cp ../docs/bench_logs/h200-2026-12-03-run10/bench_barrier.py .
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 420 python bench_barrier.py > $OUT/h1_barrier.log 2>&1
grep -E "^==|input_add_reduce|other " $OUT/h1_barrier.log | head -30
