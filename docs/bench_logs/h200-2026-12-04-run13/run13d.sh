#!/usr/bin/env bash
# Thirteenth H200 run, call D (no TE): the split layers, their gradients now written into an uninitialised buffer,
# against the fully unrolled scan, one process; then batch 32 in four micro-batches.
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
cd experiments
cp ../docs/bench_logs/h200-2026-12-04-run13/bench_split.py .
timeout 280 python bench_split.py > $OUT/d1_split.log 2>&1
grep -E "^==|Error" $OUT/d1_split.log
timeout 160 python bench_train.py --preset proxy-2b --batch 32 --micro-batches 4 --seq 2048 \
  --attention-impl cudnn --backends pallas --steps 3 --unroll-layers > $OUT/d2_train_b32_m4.log 2>&1
tail -1 $OUT/d2_train_b32_m4.log
