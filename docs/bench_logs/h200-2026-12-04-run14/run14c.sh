#!/usr/bin/env bash
# Fourteenth H200 run, call C (no TE): counting copies per expert by scatter-add or by compare
# and sum (kernel time, then the batch-8 step both ways in one process); GPU tests of the
# pallas bundle against the oracle, and the routing and counting tests on the GPU.
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
here=docs/bench_logs/h200-2026-12-04-run14
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 120 python -m pytest -m gpu \
  tests/backends/test_gpu_backends.py -k "(equals_oracle and pallas) or auto" -n 4 -q \
  -p no:cacheprovider > $OUT/c1_gpu_tests.log 2>&1
tail -1 $OUT/c1_gpu_tests.log
# the routing and counting property tests, on the GPU as JAX's default device
timeout 80 python -m pytest tests/test_routing.py tests/test_balance.py -q -p no:cacheprovider \
  > $OUT/c1_routing_tests_on_gpu.log 2>&1
tail -1 $OUT/c1_routing_tests_on_gpu.log
cd experiments
cp ../$here/bench_counts.py .
timeout 380 python bench_counts.py > $OUT/c2_counts.log 2>&1
grep -E "^==|Error" $OUT/c2_counts.log
