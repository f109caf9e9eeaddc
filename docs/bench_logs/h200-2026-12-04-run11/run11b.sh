#!/usr/bin/env bash
# Eleventh H200 run, call B (no TE): the unrolled proxy-2b train step on pallas with MLA's value
# heads at their own width, at batch 8 in one pass and batch 16 / 32 in micro-batches of 8.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
cd experiments
for bm in "8 1" "32 4" "16 2"; do
  set -- $bm
  timeout 190 python bench_train.py --preset proxy-2b --batch $1 --micro-batches $2 --seq 2048 \
    --attention-impl cudnn --backends pallas --steps 3 --unroll-layers > $OUT/b_train_b$1_m$2.log 2>&1
  tail -1 $OUT/b_train_b$1_m$2.log
done
