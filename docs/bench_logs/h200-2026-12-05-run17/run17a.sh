#!/usr/bin/env bash
# Seventeenth H200 run, call A (no TE): the GPU tests on the code as committed (bf16 parameters
# through dropless.precision.apply_updates are new since the last GPU run), the row-gather
# kernel against XLA's (alone and in the batch-24 step), and attention at MLA's head widths.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/experiments:/tmp/site
(nvidia-smi; python -c "import jax; print(jax.__version__, jax.devices())"; git log -1 --oneline) > $OUT/a0_machine.log 2>&1
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 230 python -m pytest -m gpu -n 4 -q -p no:cacheprovider \
  tests/ > $OUT/a1_gpu_tests.log 2>&1
tail -n 1 $OUT/a1_gpu_tests.log
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 60 python -m pytest tests/train/test_step.py tests/test_precision.py \
  -q -p no:cacheprovider > $OUT/a1_step_tests_on_gpu.log 2>&1
tail -n 1 $OUT/a1_step_tests_on_gpu.log
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
cd experiments
timeout 60 python bench_attention.py --out $OUT/results_attention > $OUT/a2_attention.log 2>&1
tail -n 8 $OUT/a2_attention.log
timeout 200 python bench_row_gather.py --step --batch 24 > $OUT/a3_row_gather_b24.log 2>&1
grep -E "Error|ran out" $OUT/a3_row_gather_b24.log | cut -c 1-300; tail -n 12 $OUT/a3_row_gather_b24.log
