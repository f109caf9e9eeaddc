#!/usr/bin/env bash
# Fourteenth H200 run, call E (no TE): the GPU tests of call D at the review fixes (6841e23:
# the top-k's NaN key, the counts' platform choice), and row-gather variants by kernel time.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
here=docs/bench_logs/h200-2026-12-04-run14
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python -m pytest -m gpu \
  tests/backends/test_gpu_backends.py -k "(equals_oracle and pallas) or auto" -n 4 -q \
  -p no:cacheprovider > $OUT/e1_gpu_tests.log 2>&1
tail -1 $OUT/e1_gpu_tests.log
timeout 90 python -m pytest tests/test_routing.py tests/test_balance.py -q -p no:cacheprovider \
  > $OUT/e1_routing_tests_on_gpu.log 2>&1
tail -1 $OUT/e1_routing_tests_on_gpu.log
cd experiments
cp ../$here/bench_gather.py .
timeout 90 python bench_gather.py > $OUT/e2_gather.log 2>&1
grep -E "^==|Error" $OUT/e2_gather.log
