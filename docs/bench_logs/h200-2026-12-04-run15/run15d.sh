#!/usr/bin/env bash
# Fifteenth H200 run, call D (no TE): where the batch-8 step goes with gate and up as one
# grouped matmul (kernel time per scope, command buffers off).
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:$PWD/experiments
cd experiments
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 400 python bench_train.py --preset proxy-2b \
  --seq 2048 --attention-impl cudnn --backends pallas --unroll-layers --batch 8 --steps 3 \
  --profile --profile-top 40 --out $OUT/results > $OUT/d1_profile.log 2>&1
grep -A 14 "device time per step by scope" $OUT/d1_profile.log; tail -n 3 $OUT/d1_profile.log
rm -f $OUT/results/*.json.gz
