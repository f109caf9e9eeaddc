#!/usr/bin/env bash
# Fifteenth H200 run, call A (no TE): the GPU tests with the word-view row gather (f36075d),
# XLA's unroll limit against bf16's byte rate, and the step with and without the word view.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/experiments:/tmp/site
here=$PWD/docs/bench_logs/h200-2026-12-04-run15
(nvidia-smi; python -c "import jax; print(jax.__version__, jax.devices())"; git log -1 --oneline) > $OUT/a0_machine.log 2>&1
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python -m pytest -m gpu \
  tests/backends/test_gpu_backends.py -k "(equals_oracle and pallas) or auto" -n 4 -q \
  -p no:cacheprovider > $OUT/a1_gpu_tests.log 2>&1
tail -n 1 $OUT/a1_gpu_tests.log
timeout 120 python -m pytest tests/test_routing.py tests/test_balance.py tests/backends/test_jnp.py \
  -q -p no:cacheprovider > $OUT/a1_core_tests_on_gpu.log 2>&1
tail -n 1 $OUT/a1_core_tests_on_gpu.log
cd experiments
timeout 60 python $here/unroll_fill.py > $OUT/a2_unroll_fill.log 2>&1
grep -E "^==|Error" $OUT/a2_unroll_fill.log
timeout 300 python $here/step_gather.py > $OUT/a3_step_gather.log 2>&1
grep -E "^==|Error" $OUT/a3_step_gather.log
