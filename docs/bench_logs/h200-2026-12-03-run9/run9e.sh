#!/usr/bin/env bash
# Ninth H200 run, call E (no TE): half-block passes in the forward / input-gradient kernel
# (KernelConfig.half_blocks): GPU tests, then a tile search against whole-block passes.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 100 python -m pytest -m gpu tests/backends/test_gpu_backends.py \
  -k "mosaic_kernels or chained" -n 4 -q -rA -p no:cacheprovider > $OUT/e1_gpu_tests.log 2>&1
grep -cE "^PASSED" $OUT/e1_gpu_tests.log; grep -E "^(FAILED|ERROR)" $OUT/e1_gpu_tests.log | head; tail -1 $OUT/e1_gpu_tests.log
cd experiments
timeout 120 python tune_mosaic.py --ops fwd,dgrad --candidates "128x2x128 s3 b4" --budget 80 \
  --cases 7168x2048@256x256,7168x2048@64x512,7168x2048@8x2048,2048x7168@256x256 --out /tmp/tune > $OUT/e2_tune_half.log 2>&1
cp /tmp/tune/tune_mosaic.csv $OUT/e2_tune_half.csv
grep -E "^(fwd|dgrad) " $OUT/e2_tune_half.log
