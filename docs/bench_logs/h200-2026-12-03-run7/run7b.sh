#!/usr/bin/env bash
# Seventh H200 run, call B: MoE layer with TE and Pallas in one run; train steps; a profile of
# the pallas train step with command buffers off (kernel names kept).
source .te/env.sh
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
cd experiments
timeout 210 python bench_moe.py --skip-gmm --layer-backends te,pallas --out $OUT/layer > $OUT/b1_layer.log 2>&1
grep -v "^ *$" $OUT/b1_layer.log | tail -14
timeout 150 python bench_train.py --preset proxy-2b --batch 8 --seq 2048 --attention-impl cudnn --backends pallas,te-gmm --steps 3 --out $OUT/train > $OUT/b2_train.log 2>&1
tail -5 $OUT/b2_train.log
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 130 python bench_train.py --preset proxy-2b --batch 8 --seq 2048 --attention-impl cudnn --backends pallas --steps 2 --profile --out $OUT/train_profile > $OUT/b3_train_profile.log 2>&1
grep -v "^ *$" $OUT/b3_train_profile.log | head -70
