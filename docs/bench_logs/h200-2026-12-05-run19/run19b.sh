#!/usr/bin/env bash
# Nineteenth H200 run, call B (no TE): the GPU tests with proxy-2b's new heads, then the
# batch-24 step's profile (command buffers off) with the model overrides given as arguments.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/experiments:/tmp/site
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 300 python -m pytest -m gpu -n 4 -q -p no:cacheprovider tests/ \
  > $OUT/b1_gpu_tests.log 2>&1
tail -n 3 $OUT/b1_gpu_tests.log
cd experiments && XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 240 \
  python bench_train.py --preset proxy-2b --seq 2048 --attention-impl cudnn --backends pallas --unroll-layers \
  --batch 24 --steps 2 --profile --profile-top 40 --out /tmp/rb ${1:+--set "$@"} > $OUT/b2_profile_b24.log 2>&1
grep -E "Error|RESOURCE" $OUT/b2_profile_b24.log | cut -c 1-300; head -c 3500 $OUT/b2_profile_b24.log
