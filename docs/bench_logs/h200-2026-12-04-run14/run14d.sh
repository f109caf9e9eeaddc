#!/usr/bin/env bash
# Fourteenth H200 run, call D (no TE): call C's tests again with the test extras' wheels
# (beartype, pytest-xdist, carried in .whl/); then the batch-8 step with routing's top-k both
# ways in one process.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
here=docs/bench_logs/h200-2026-12-04-run14
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python -m pytest -m gpu \
  tests/backends/test_gpu_backends.py -k "(equals_oracle and pallas) or auto" -n 4 -q \
  -p no:cacheprovider > $OUT/d1_gpu_tests.log 2>&1
tail -1 $OUT/d1_gpu_tests.log
timeout 90 python -m pytest tests/test_routing.py tests/test_balance.py -q -p no:cacheprovider \
  > $OUT/d1_routing_tests_on_gpu.log 2>&1
tail -1 $OUT/d1_routing_tests_on_gpu.log
cd experiments
cp ../$here/bench_topk_step.py .
timeout 330 python bench_topk_step.py > $OUT/d2_topk_step.log 2>&1
grep -E "^==|Error" $OUT/d2_topk_step.log
