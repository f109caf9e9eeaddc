#!/usr/bin/env bash
# Sixteenth H200 run, call B (no TE): the hand-written backwards of RMSNorm, SwiGLU and the
# cross-entropy: their tests on the GPU, what the batch-8 step keeps for its backward now, the
# batch-16 step before/after in one process, and batch 24 in one pass.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/experiments:/tmp/site
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
here=$PWD/docs/bench_logs/h200-2026-12-04-run16
timeout 120 python -m pytest tests/nn/test_rmsnorm.py tests/nn/test_mlp.py tests/train/test_cross_entropy.py \
  tests/test_experts.py -q -p no:cacheprovider > $OUT/b1_tests_on_gpu.log 2>&1
tail -n 1 $OUT/b1_tests_on_gpu.log
cd experiments
timeout 60 python $here/residuals.py pallas 8 cudnn > $OUT/b2_residuals.log 2>&1
tail -n 1 $OUT/b2_residuals.log
timeout 280 python $here/step_backwards.py 16 > $OUT/b3_step_backwards_b16.log 2>&1
grep -E "^==|Error|ran out" $OUT/b3_step_backwards_b16.log | cut -c 1-300
timeout 150 python bench_train.py --preset proxy-2b --seq 2048 --attention-impl cudnn \
  --backends pallas --unroll-layers --batch 24 --steps 3 --out $OUT/results > $OUT/b4_train_b24_m1.log 2>&1
grep -E "Can't reduce|ran out" $OUT/b4_train_b24_m1.log | cut -c 1-300; tail -n 2 $OUT/b4_train_b24_m1.log
