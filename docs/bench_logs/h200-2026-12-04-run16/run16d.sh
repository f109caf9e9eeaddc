#!/usr/bin/env bash
# Sixteenth H200 run, call D (no TE): the batch-24 step with the cross-entropy by autodiff
# and with its one-pass forward, in one process.
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/experiments:$PWD/docs/bench_logs/h200-2026-12-04-run16
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
here=$PWD/docs/bench_logs/h200-2026-12-04-run16
cd experiments
timeout 300 python $here/step_cross_entropy.py > $OUT/d1_step_cross_entropy_b24.log 2>&1
grep -E "^==|Error|ran out" $OUT/d1_step_cross_entropy_b24.log | cut -c 1-300
