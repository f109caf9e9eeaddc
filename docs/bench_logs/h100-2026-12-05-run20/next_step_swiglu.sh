#!/usr/bin/env bash
# Written after the twentieth run, for any Hopper GPU (batch 16 fits an H100; pass 24 on an
# H200): the step with and without the fused SwiGLU (step_fused_swiglu.py), two rounds, after
# the GPU test that checks the fused path against the plain one. About 8 minutes.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/experiments:/tmp/site:$PWD/docs/bench_logs/h100-2026-12-05-run20
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 python -m pytest -q -p no:cacheprovider -m gpu \
  tests/backends/test_gpu_backends.py -k "swiglu" > $OUT/s1_swiglu_gpu_tests.log 2>&1; tail -2 $OUT/s1_swiglu_gpu_tests.log
cd experiments
timeout 450 python ../docs/bench_logs/h100-2026-12-05-run20/step_fused_swiglu.py ${1:-16} \
  > $OUT/s2_step_fused_swiglu.log 2>&1
grep -E "Error|RESOURCE" $OUT/s2_step_fused_swiglu.log | cut -c 1-300; grep -E "^==" $OUT/s2_step_fused_swiglu.log
