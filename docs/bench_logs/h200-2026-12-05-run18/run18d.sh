#!/usr/bin/env bash
# Eighteenth H200 run, call D (no TE): the batch-24 step's profile with 8 heads of DeepSeek-V3's
# widths, command buffers off (with them on, as in call B's b2_profile_b24.log, every kernel
# lands in one command buffer and the scopes are lost).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/experiments XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
cd experiments && XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 220 python bench_train.py \
  --preset proxy-2b --seq 2048 --attention-impl cudnn --backends pallas --unroll-layers --batch 24 \
  --steps 2 --profile --profile-top 40 --out /tmp/rb \
  --set num_attention_heads=8 qk_nope_head_dim=128 qk_rope_head_dim=64 v_head_dim=128 \
  > $OUT/d1_profile_b24_v3_heads.log 2>&1
head -c 3000 $OUT/d1_profile_b24_v3_heads.log
