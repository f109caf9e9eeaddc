#!/usr/bin/env bash
# Fourteenth H200 run, call B (no TE): the batch-8 step's kernel time by scope and by op
# (command buffers off, as for every profile), then batch 32 in four micro-batches.
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
cd experiments
common="--preset proxy-2b --seq 2048 --attention-impl cudnn --backends pallas --unroll-layers"
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 270 python bench_train.py $common --batch 8 \
  --steps 3 --profile --profile-top 40 --out $OUT/b1 > $OUT/b1_profile.log 2>&1
grep -A14 "device time per step by scope" $OUT/b1_profile.log | head -16
timeout 250 python bench_train.py $common --batch 32 --micro-batches 4 --steps 3 \
  > $OUT/b2_train_b32_m4.log 2>&1
tail -1 $OUT/b2_train_b32_m4.log
rm -f $OUT/b1/*.json.gz
