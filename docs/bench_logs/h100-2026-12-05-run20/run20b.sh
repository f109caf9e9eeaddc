#!/usr/bin/env bash
# Twentieth run, call B (no TE, an H200: batch 24 needs 94 GiB, call A's a3 log): the loss's
# reduction variants alone (bench_cross_entropy_run20.py, batch 24's 49152 positions),
# then the batch-24 step with float32 logits and with bfloat16 logits under each variant
# (step_loss_reduction.py; the second argument picks variants, all if none; $BATCH: 24 if unset;
# the first, "nobench": no variants alone; the third: the step script's time limit).
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:$PWD/experiments:/tmp/site:$PWD/docs/bench_logs/h100-2026-12-05-run20
(nvidia-smi; python -c "import jax; print(jax.__version__, jax.devices())") > $OUT/b0_machine.log 2>&1
grep -E "NVIDIA H|MiB" $OUT/b0_machine.log | head -3
cd experiments
if [ "$1" != nobench ]; then
  timeout 100 python ../docs/bench_logs/h100-2026-12-05-run20/bench_cross_entropy_run20.py > $OUT/b1_bench_cross_entropy.log 2>&1
  grep -E "Error" $OUT/b1_bench_cross_entropy.log | cut -c 1-300; tail -8 $OUT/b1_bench_cross_entropy.log
fi
timeout ${3:-460} python ../docs/bench_logs/h100-2026-12-05-run20/step_loss_reduction.py ${BATCH:-24} $2 > $OUT/b2_step_loss_reduction_b${BATCH:-24}.log 2>&1
grep -E "Error|RESOURCE" $OUT/b2_step_loss_reduction_b${BATCH:-24}.log | cut -c 1-300; grep -E "^==" $OUT/b2_step_loss_reduction_b${BATCH:-24}.log
