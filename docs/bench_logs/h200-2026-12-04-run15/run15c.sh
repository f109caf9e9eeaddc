#!/usr/bin/env bash
# Fifteenth H200 run, call C (no TE): the MLA/SwiGLU/experts tests on the GPU; the step with
# MLA's q_a and kv_a as one or two matmuls; batch 32 in four micro-batches at the library.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/experiments:/tmp/site
here=$PWD/docs/bench_logs/h200-2026-12-04-run15
timeout 100 python -m pytest tests/nn/test_mla.py tests/nn/test_mlp.py tests/test_experts.py -q \
  -p no:cacheprovider > $OUT/c1_nn_tests_on_gpu.log 2>&1
tail -n 1 $OUT/c1_nn_tests_on_gpu.log
cd experiments
timeout 240 python $here/step_mla.py > $OUT/c2_step_mla.log 2>&1
grep -E "^==|Error" $OUT/c2_step_mla.log
timeout 200 python bench_train.py --preset proxy-2b --seq 2048 --attention-impl cudnn \
  --backends pallas --unroll-layers --batch 32 --micro-batches 4 --steps 3 \
  --out $OUT/results > $OUT/c3_train_b32_m4.log 2>&1
tail -n 4 $OUT/c3_train_b32_m4.log
