#!/usr/bin/env bash
# Twelfth H200 run, call B (no TE): how the unrolled step builds its stacked gradients
# (bench_unroll.py, four variants in one process, command buffers on).
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
cd experiments
cp ../docs/bench_logs/h200-2026-12-04-run12/bench_unroll.py .
timeout 560 python bench_unroll.py > $OUT/b1_unroll.log 2>&1
grep -E "^==|Error" $OUT/b1_unroll.log
