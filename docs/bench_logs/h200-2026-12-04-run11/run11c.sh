#!/usr/bin/env bash
# Eleventh H200 run, call C (no TE): stacked matmul weights cast once, their gradients stacked in
# bf16 (bench_cast.py, three variants in one process, command buffers on).
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
cd experiments
cp ../docs/bench_logs/h200-2026-12-04-run11/bench_cast.py .
timeout 520 python bench_cast.py > $OUT/c1_cast.log 2>&1
grep -E "^==|Error" $OUT/c1_cast.log
