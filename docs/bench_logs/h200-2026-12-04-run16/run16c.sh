#!/usr/bin/env bash
# Sixteenth H200 run, call C (no TE): batch 24 in one pass with the hand-written backwards and,
# in the same process after it, with autodiff's (does it fit?); then where the batch-24 step
# goes (kernel time per scope, command buffers off).
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/experiments
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
here=$PWD/docs/bench_logs/h200-2026-12-04-run16
cd experiments
timeout 250 python $here/step_backwards.py 24 now-first > $OUT/c1_step_backwards_b24.log 2>&1
grep -E "^==|Error|ran out" $OUT/c1_step_backwards_b24.log | cut -c 1-300
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 290 python bench_train.py --preset proxy-2b \
  --seq 2048 --attention-impl cudnn --backends pallas --unroll-layers --batch 24 --steps 3 \
  --profile --profile-top 40 --out $OUT/results > $OUT/c2_profile_b24.log 2>&1
grep -A 14 "device time per step by scope" $OUT/c2_profile_b24.log; tail -n 3 $OUT/c2_profile_b24.log
rm -f $OUT/results/*.json.gz
