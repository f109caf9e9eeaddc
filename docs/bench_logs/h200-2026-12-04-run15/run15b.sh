#!/usr/bin/env bash
# Fifteenth H200 run, call B (no TE): the CPU suite's float32 tests that failed under TF32 in
# call A, now at 'highest' precision; the optimiser tests; the GPU tests with gate and up as one
# grouped matmul; the step with one or two matmuls, and with bf16 AdamW moments.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/experiments:/tmp/site
here=$PWD/docs/bench_logs/h200-2026-12-04-run15
git log -1 --oneline > $OUT/b0_commit.log
timeout 100 python -m pytest tests/backends/test_jnp.py tests/train/test_optim.py -q \
  -p no:cacheprovider > $OUT/b1_core_tests_on_gpu.log 2>&1
tail -n 1 $OUT/b1_core_tests_on_gpu.log
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python -m pytest -m gpu \
  tests/backends/test_gpu_backends.py -k "(equals_oracle and pallas) or auto" -n 4 -q \
  -p no:cacheprovider > $OUT/b1_gpu_tests.log 2>&1
tail -n 1 $OUT/b1_gpu_tests.log
cd experiments
timeout 330 python $here/step_gate_up.py > $OUT/b2_step_gate_up.log 2>&1
grep -E "^==|Error" $OUT/b2_step_gate_up.log
