#!/usr/bin/env bash
# Seventh H200 run, call D: the proxy-2b train step with the layer scan unrolled vs scanned.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
cd experiments
A="--preset proxy-2b --batch 8 --seq 2048 --attention-impl cudnn --backends pallas --steps 3"
/usr/bin/time -f "wall %e s" timeout 170 python bench_train.py $A --unroll-layers --out $OUT/unrolled > $OUT/d1_train_unrolled.log 2>&1
tail -4 $OUT/d1_train_unrolled.log
/usr/bin/time -f "wall %e s" timeout 90 python bench_train.py $A --out $OUT/scanned > $OUT/d2_train_scanned.log 2>&1
tail -4 $OUT/d2_train_scanned.log
