#!/usr/bin/env bash
# Nineteenth H200 run, call C (no TE): the step with float32 against bfloat16 logits
# (step_logits.py; batch: the first argument, 24 if none; rounds: the third, 2 if none), then,
# unless the second argument is "noprofile", the batch-24 step's profile with bfloat16 logits
# (command buffers off).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/experiments XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
cd experiments
timeout 360 python ../docs/bench_logs/h200-2026-12-05-run19/step_logits.py ${1:-24} ${3:-2} > $OUT/c1_step_logits.log 2>&1
grep -E "Error|RESOURCE" $OUT/c1_step_logits.log | cut -c 1-300; grep -E "^==" $OUT/c1_step_logits.log
[ "$2" = noprofile ] && exit 0
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 200 python bench_train.py --preset proxy-2b --seq 2048 \
  --attention-impl cudnn --backends pallas --unroll-layers --batch 24 --steps 2 --profile --profile-top 40 \
  --out /tmp/rc --set logits_dtype=bfloat16 > $OUT/c2_profile_b24_bf16_logits.log 2>&1
grep -E "Error|RESOURCE" $OUT/c2_profile_b24_bf16_logits.log | cut -c 1-300
sed -n '/device time per step by scope/,/^$/p;/^head: kernels/,/^$/p;/^head (bwd): kernels/,/^$/p;/^other: kernels/,/^$/p' $OUT/c2_profile_b24_bf16_logits.log
