#!/usr/bin/env bash
# Tenth H200 run, call G (no TE): where the time goes, with command buffers off so kernels keep
# their names: the pallas MoE layer at 8192 tokens, and the proxy-2b train step on pallas with
# the layers unrolled (the 25.2% MFU setting of the seventh run), then the same step timed with
# command buffers on.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
cd experiments
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 150 python bench_moe.py --skip-gmm --layer-backends pallas \
  --tokens 8192 --profile --out /tmp/layer > $OUT/g1_layer_profile.log 2>&1
grep -v "^ *$" $OUT/g1_layer_profile.log | tail -40
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 230 python bench_train.py --preset proxy-2b --batch 8 --seq 2048 \
  --attention-impl cudnn --backends pallas --steps 2 --unroll-layers --profile --profile-top 80 > $OUT/g2_train_profile.log 2>&1
grep -v "^ *$" $OUT/g2_train_profile.log | head -60
timeout 180 python bench_train.py --preset proxy-2b --batch 8 --seq 2048 --attention-impl cudnn --backends pallas \
  --steps 3 --unroll-layers > $OUT/g3_train.log 2>&1
tail -4 $OUT/g3_train.log
