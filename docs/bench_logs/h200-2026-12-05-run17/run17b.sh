#!/usr/bin/env bash
# Seventeenth H200 run, call B (no TE): dropless.backends.row_gather's kernel alone and, as
# PallasSortDispatcher, in the batch-24 step; before that, its GPU tests, the bf16-parameter
# step test and the precision tests (call A's ran out of time), and the kernel at DeepSeek-V3's width.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/experiments:/tmp/site
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
git log -1 --oneline > $OUT/b0_commit.log
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 100 python -m pytest tests/backends/test_row_gather.py \
  tests/test_precision.py tests/train/test_step.py::test_bfloat16_parameters_stay_bfloat16 \
  -n 3 -q -p no:cacheprovider \
  > $OUT/b1_tests_on_gpu.log 2>&1
tail -n 1 $OUT/b1_tests_on_gpu.log
cd experiments
timeout 60 python bench_row_gather.py --tokens 8192 --dim 7168 --k 8 > $OUT/b2_row_gather_v3_width.log 2>&1
tail -n 2 $OUT/b2_row_gather_v3_width.log | cut -c 1-400
timeout 330 python bench_row_gather.py --step --batch 24 > $OUT/b3_row_gather_b24.log 2>&1
grep -E "Error|ran out" $OUT/b3_row_gather_b24.log | cut -c 1-300; grep -E "^\{|^==" $OUT/b3_row_gather_b24.log | cut -c 1-400
