#!/usr/bin/env bash
# Written after the twentieth run for the next H200 (batch 24 needs 94 GiB): the library's
# cross-entropy tests on the GPU (its one-pass forward runs there only), then the batch-24 step
# with float32 against bfloat16 logits, two rounds (the nineteenth run's step_logits.py), the
# MFU record for issue 5. Logs to $OUT; about 9 minutes.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/experiments:/tmp/site
(nvidia-smi; python -c "import jax; print(jax.__version__, jax.devices())") > $OUT/a0_machine.log 2>&1
grep -E "NVIDIA H|MiB" $OUT/a0_machine.log | head -3
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 90 python -m pytest -q -p no:cacheprovider \
  tests/train/test_cross_entropy.py > $OUT/a1_cross_entropy_tests.log 2>&1; tail -2 $OUT/a1_cross_entropy_tests.log
cd experiments
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 470 python ../docs/bench_logs/h200-2026-12-05-run19/step_logits.py \
  ${1:-24} 2 > $OUT/a2_step_logits_b${1:-24}.log 2>&1
grep -E "Error|RESOURCE" $OUT/a2_step_logits_b${1:-24}.log | cut -c 1-300; grep -E "^==" $OUT/a2_step_logits_b${1:-24}.log
