#!/usr/bin/env bash
# Tenth H200 run, call I (no TE): the unrolled proxy-2b train step on pallas at batch 8 in one
# pass, and at batch 16 and 32 in micro-batches of 8 (gradient accumulation, TrainConfig.micro_batches).
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
cd experiments
for bm in "8 1" "16 2" "32 4"; do
  set -- $bm
  timeout 130 python bench_train.py --preset proxy-2b --batch $1 --micro-batches $2 --seq 2048 \
    --attention-impl cudnn --backends pallas --steps 3 --unroll-layers > $OUT/i_train_b$1_m$2.log 2>&1
  tail -2 $OUT/i_train_b$1_m$2.log
done
