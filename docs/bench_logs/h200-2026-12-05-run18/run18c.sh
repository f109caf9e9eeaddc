#!/usr/bin/env bash
# Eighteenth H200 run, call C (no TE): the batch-24 step with the three dispatchers (XLA's
# gathers, the expansion kernel, the expansion kernel with the fused combine backward) in one
# process, after the kernels alone.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/experiments:/tmp/site
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
cd experiments
timeout 540 python bench_row_gather.py --step --batch 24 > $OUT/c1_row_gather_b24.log 2>&1
grep -E "Error|ran out" $OUT/c1_row_gather_b24.log | cut -c 1-300; grep -E "^\{|^==" $OUT/c1_row_gather_b24.log | cut -c 1-400
