#!/usr/bin/env bash
# Fifteenth H200 run, call F (no TE): the step with AdamW's moments in float32 and in bf16,
# this time with the bf16 moments checked in the state (call B's bf16 row ran float32).
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/experiments
cd experiments
timeout 250 python ../docs/bench_logs/h200-2026-12-04-run15/step_moments.py > $OUT/f1_step_moments.log 2>&1
grep -E "^==|Error" $OUT/f1_step_moments.log
