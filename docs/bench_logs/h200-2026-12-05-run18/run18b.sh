#!/usr/bin/env bash
# Eighteenth H200 run, call B (no TE): the GPU tests, then the batch-24 step's profile, with
# the model overrides given as arguments (bench_train.py --set ...), if any.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/experiments:/tmp/site
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 280 python -m pytest -m gpu -n 4 -q -p no:cacheprovider tests/ \
  > $OUT/b1_gpu_tests.log 2>&1
tail -n 3 $OUT/b1_gpu_tests.log
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
cd experiments
timeout 280 python bench_train.py --preset proxy-2b --seq 2048 --attention-impl cudnn --backends pallas \
  --unroll-layers --batch 24 --steps 3 --profile --out $OUT/results_b ${1:+--set "$@"} > $OUT/b2_profile_b24.log 2>&1
grep -E "Error|RESOURCE" $OUT/b2_profile_b24.log | cut -c 1-300; head -n 30 $OUT/b2_profile_b24.log | cut -c 1-200
