#!/usr/bin/env bash
# Seventh H200 run, call C: weight-gradient band 16 checked; the grouped-GEMM benchmark with the
# forward really run (value and gradients, random cotangent), both orientations, TE and Pallas;
# the pallas train step profiled with every kernel listed; batch 16.
bash .te/recv.sh || exit 1
source .te/env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python -m pytest -m gpu tests/backends/test_gpu_backends.py -k "mosaic_kernels or (equals_oracle and pallas)" -n 4 -q > $OUT/c1_gpu_tests.log 2>&1
tail -2 $OUT/c1_gpu_tests.log; grep -E "^(FAILED|ERROR)" $OUT/c1_gpu_tests.log | head
cd experiments
timeout 250 python bench_moe.py --skip-layer --strategies te,pallas,jnp-capacity --out $OUT/gmm > $OUT/c2_gmm.log 2>&1
grep -v "^ *$" $OUT/c2_gmm.log | grep -v "^experts" | tail -36
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 100 python bench_train.py --preset proxy-2b --batch 8 --seq 2048 --attention-impl cudnn --backends pallas --steps 2 --profile --profile-top 150 --out /tmp/prof > $OUT/c3_train_profile.log 2>&1
tail -3 $OUT/c3_train_profile.log
timeout 80 python bench_train.py --preset proxy-2b --batch 16 --seq 2048 --attention-impl cudnn --backends pallas --steps 3 --out /tmp/b16 > $OUT/c4_train_b16.log 2>&1
tail -3 $OUT/c4_train_b16.log
